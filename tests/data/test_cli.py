"""`dspark data`: one group, registered in dspark.data.cli, with every subcommand of the pipeline."""

import argparse
import json

import pytest

from dspark.data.cli import add_cli, read_config_fields
from dspark.errors import DSparkError
from dspark.training.config import load_config, preset_names


def _data_commands() -> dict[str, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    group = next(a for a in parser._subparsers._group_actions if "data" in a.choices).choices["data"]
    return next(a for a in group._subparsers._group_actions).choices


def test_the_data_group_has_every_subcommand():
    assert set(_data_commands()) == {"prompts", "self-prompts", "fetch-archives", "regenerate", "merge", "label",
                                     "tokenize", "features", "vocab"}


@pytest.mark.parametrize("preset", preset_names())
def test_features_reads_a_training_config_like_training_does(preset):
    """`dspark data features --config` cannot import dspark.training (same layer); it must agree with it."""
    overrides = ["max_length=1024", "data=some/tok", "target=elsewhere"]
    for given in ([], overrides):
        cfg, fields = load_config(preset, given), read_config_fields(preset, given)
        assert fields["target"] == cfg.target and fields["data"] == cfg.data
        assert fields["max_length"] == cfg.max_length
        assert fields["model"].get("target_layer_ids") == cfg.model.get("target_layer_ids")


def test_features_config_from_a_file_and_errors(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"target": "t", "data": "tok", "lr": 1e-4}))
    cfg, fields = load_config(str(path)), read_config_fields(str(path))
    assert (fields["target"], fields["data"], fields["max_length"]) == (cfg.target, cfg.data, cfg.max_length)
    with pytest.raises(DSparkError, match="no such preset"):
        read_config_fields("no-such-preset")
    with pytest.raises(DSparkError, match="key=value"):
        read_config_fields(str(path), ["max_length"])
