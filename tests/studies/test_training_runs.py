"""The training-runs budget table (scripts/training_table.py) from fake `dspark train` outputs."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from dspark.studies.training_runs import training_runs_markdown


def test_one_row_per_finished_run(tmp_path):
    run = tmp_path / "train" / "dspark-markov"
    (run / "step_latest").mkdir(parents=True)
    (run / "train_summary.json").write_text(json.dumps({
        "steps": 12, "global_batch": 4, "tokens_seen": 9000.4, "train_seconds_total": 60.2, "tokens_per_s": 149.6,
        "final_metrics": {"tau": 9.0}}))  # one batch's estimate: the table averages the last logged steps instead
    (run / "metrics.jsonl").write_text('{"step": 5, "tau": 2.3}\n{"step": 10, "tau": 2.4}\n')
    (run / "step_latest" / "train_config.json").write_text(json.dumps(
        {"drafter": "dspark", "dtype": "bfloat16", "time_budget_s": 60.0}))
    save_file({"embed_tokens.weight": torch.zeros(10, 100), "layers.0.w": torch.zeros(1000, 1000)},
              str(run / "step_latest" / "model.safetensors"))
    (tmp_path / "train" / "unfinished").mkdir()
    text = training_runs_markdown([tmp_path / "train"], "python scripts/training_table.py")
    assert "Written by `python scripts/training_table.py`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "run |" not in line]
    assert rows == ["| dspark-markov | dspark | bfloat16 | 60 s | 12 | 4 | 48 | 9000 | 60 | 150 | 1.0M / 1.0M | 2.35 |"]
