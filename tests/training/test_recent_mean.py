"""The trainer's recent estimate: the mean of a metric over the last logged steps of metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from dspark.training.trainer import recent_mean


def test_mean_over_the_last_lines_skips_half_written_and_missing_values(tmp_path):
    lines = [json.dumps({"step": 5 * i, "tau": float(i)}) for i in range(1, 11)]  # tau 1..10
    lines.insert(3, json.dumps({"step": 17}))  # a line without the key
    text = "\n".join(lines) + '\n{"step": 55, "tau": 9'  # a killed run's half-written last line
    (tmp_path / "metrics.jsonl").write_text(text)
    assert recent_mean(tmp_path, "tau", lines=4) == pytest.approx((7 + 8 + 9 + 10) / 4)
    assert recent_mean(tmp_path, "tau") == pytest.approx(5.5)  # fewer lines than asked: all of them
    assert recent_mean(tmp_path, "acc@0") is None


def test_no_metrics_file_is_none(tmp_path):
    assert recent_mean(tmp_path / "nothing", "tau") is None
