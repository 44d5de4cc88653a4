"""`dspark bench`: one group, registered once in dspark.cli, with `serve` and `speed`."""

from __future__ import annotations

import argparse
import sys

import pytest

from dspark.bench.cli import _command_line
from dspark.cli import build_parser


def _choices(parser: argparse.ArgumentParser) -> list[str]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_every_command_is_registered_once_in_the_listed_order():
    parser = build_parser()
    assert _choices(parser) == ["prepare", "generate", "data", "train", "export-vocab", "export", "eval", "calibrate",
                                "reproduce", "profile", "profile-sps", "serve", "simulate", "bench", "demo"]
    bench = parser._subparsers._group_actions[0].choices["bench"]
    assert _choices(bench) == ["serve", "speed", "chaos", "train"]


def test_bench_commands_parse_their_flags():
    parser = build_parser()
    args = parser.parse_args(["bench", "serve", "--policies", "alg1,all", "--concurrency", "1,4"])
    assert (args.policies, args.concurrency, args.threads) == (["alg1", "all"], [1, 4], None)
    args = parser.parse_args(["--threads", "2", "bench", "speed", "--drafter", "d=runs/x", "--block-sizes", "7,3",
                              "--temperatures", "0"])
    assert (args.drafters, args.block_sizes, args.temperatures, args.threads) == ([["d", "runs/x"]], [7, 3], [0.0], 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "speed", "--block-sizes", "0"])


def test_bench_without_a_command_prints_its_help(capsys):
    from dspark.cli import main

    assert main(["bench"]) == 2
    assert "serve" in capsys.readouterr().out


@pytest.mark.parametrize("argv, command, expected", [
    (["dspark", "--threads", "1", "bench", "speed", "--per-set", "1"], "speed",
     "dspark bench speed --threads 1 --per-set 1"),
    (["my_serve_load.py", "--max-tokens", "8"], "serve", "dspark bench serve --max-tokens 8"),  # a script passing flags only
])
def test_the_report_names_the_command_that_ran(monkeypatch, argv, command, expected):
    monkeypatch.setattr(sys, "argv", argv)
    assert _command_line(command) == expected


@pytest.mark.parametrize("preset", ["smollm2-dspark-markov", "smollm2-eagle3"])
def test_bench_trains_old_path_over_the_full_vocabulary(preset, tmp_path):
    """The presets set a draft vocabulary; the old path of `dspark bench train` must switch it off (a field set to
    None is not an override), or its 'full vocabulary' row times the new path's head."""
    from dspark.bench.train import old_path_config
    from dspark.training.config import load_config

    assert load_config(preset).draft_vocab_size == 8192
    cfg = old_path_config(preset, out=str(tmp_path), max_steps=2)
    assert (cfg.draft_vocab_size, cfg.draft_vocab_file, cfg.feature_source, cfg.dtype) == (None, None, "online",
                                                                                           "float32")
