"""The drafter-kind table: one row per kind, exact architecture names, the CLI's choices."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dspark.drafters.checkpoint import arch_name
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.registry import (
    CHECKPOINT_FALLBACK,
    KIND_NAMES,
    DrafterKind,
    checkpoint_kind,
    kind_entry,
    model_kind_entry,
)
from dspark.modeling.spec import SUPPORTED

from .tiny_drafters import tiny_dflash, tiny_dspark, tiny_eagle3


def test_every_kind_has_a_complete_row():
    assert KIND_NAMES == ("dspark", "dflash", "eagle3", "draft-lm")
    for name in KIND_NAMES:
        entry = kind_entry(name)
        assert entry.kind == name and entry.kind is DrafterKind(name)
        assert dataclasses.is_dataclass(entry.config_class)
        assert isinstance(entry.make_config(), entry.config_class)
        assert callable(entry.load_drafter)
    assert kind_entry(DrafterKind.DFLASH).make_config() == DSparkConfig.dflash()
    with pytest.raises(ValueError, match="unknown drafter kind 'medusa'"):
        kind_entry("medusa")


def test_models_find_their_row(tiny):
    assert model_kind_entry(tiny_dspark(tiny)).kind is DrafterKind.DSPARK
    assert model_kind_entry(tiny_dflash(tiny)).kind is DrafterKind.DSPARK  # same classes and loss
    assert model_kind_entry(tiny_eagle3(tiny)).kind is DrafterKind.EAGLE3
    with pytest.raises(ValueError, match="not the model class"):
        model_kind_entry(object())


def _folder(tmp_path, arch: str):
    folder = tmp_path / arch
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return folder


@pytest.mark.parametrize("model_type", sorted(SUPPORTED))
def test_the_names_our_checkpoints_carry_are_in_the_table(tmp_path, model_type):
    assert checkpoint_kind(_folder(tmp_path, arch_name(model_type, "DSparkModel"))) is DrafterKind.DSPARK
    assert checkpoint_kind(_folder(tmp_path, arch_name(model_type, "Eagle3Model"))) is DrafterKind.EAGLE3


@pytest.mark.parametrize("arch, kind", [
    ("Qwen3DSparkModel", DrafterKind.DSPARK),  # DeepSpec
    ("Qwen3DFlashModel", DrafterKind.DSPARK),  # DeepSpec's DFlash: DSpark's loader
    ("DFlashDraftModel", DrafterKind.DSPARK),  # SpecForge / z-lab DFlash
    ("Qwen3Eagle3Model", DrafterKind.EAGLE3),
    ("LlamaForCausalLMEagle3", DrafterKind.EAGLE3),  # SpecForge
    ("LlamaForCausalLM", DrafterKind.DRAFT_LM),
    ("Phi3ForCausalLM", CHECKPOINT_FALLBACK),  # any other causal LM: an independent draft model
    ("MyDSparkModelV2", CHECKPOINT_FALLBACK),  # exact names only: no substring matching
])
def test_checkpoint_kind_by_exact_architecture_name(tmp_path, arch, kind):
    assert checkpoint_kind(_folder(tmp_path, arch)) is kind
