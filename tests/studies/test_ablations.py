"""The ablation series and the reduced ablation run of scripts/ablation.py (the training and eval are faked)."""

from __future__ import annotations

import json

import pytest

from dspark.errors import DSparkError
from dspark.evaluation.runner import EvalSettings, aggregate
from dspark.data.eval_sets import token_dataset
from dspark.studies.ablations import (LATEST, ReducedAblation, ablation_commands, ablation_rows, block_series,
                                      depth_series, run_reduced_ablation)
from tests.evaluation.test_runner import _record


def test_series_match_the_paper_figures():
    assert [s.x for s in depth_series()] == [1, 2, 3, 4, 5, 5]  # Fig. 3: DSpark at 1-5 layers, a 5-layer DFlash
    assert sorted({s.x for s in block_series(1)}) == [4, 8, 12, 16]  # Fig. 4: draft length gamma + 1
    assert all("model.num_draft_layers=2" in s.overrides for s in block_series(2))


def _fake_run(cfg: ReducedAblation):
    """Stands in for `dspark train` (a summary) and `dspark eval` (results of every drafter it is given)."""
    sets = [token_dataset(n, [[1]]) for n in ("gsm8k", "mbpp", "mt-bench")]
    ran = []

    def run(cmd: list[str]) -> None:
        ran.append(cmd)
        if cmd[1] == "train":
            out = cmd[cmd.index("--out") + 1]
            (cfg.out / "train" / out.rsplit("/", 1)[1]).mkdir(parents=True, exist_ok=True)
            (cfg.out / "train" / out.rsplit("/", 1)[1] / "train_summary.json").write_text(
                json.dumps({"steps": 10, "tokens_seen": 5000.0, "tokens_per_s": 50.0}))
            return
        names = [d.split("=")[0] for d in cmd[cmd.index("--drafter") + 1::2]]
        records = [_record(n, s.name, 0, [2]) for n in names for s in sets]
        (cfg.out / "eval").mkdir(parents=True, exist_ok=True)
        (cfg.out / "eval" / "results.json").write_text(json.dumps(aggregate(records, names, sets, EvalSettings())))
        (cfg.out / "eval" / "results.md").write_text("# Offline evaluation\n\n| Drafter |\n")

    return run, ran


def test_reduced_run_trains_every_drafter_then_evaluates_them_together(tmp_path):
    cfg = ReducedAblation("depth", budget_s=30, limit=1, study=tmp_path / "study", dspark="dspark")
    run, ran = _fake_run(cfg)
    doc, fig = run_reduced_ablation(cfg, docs=tmp_path / "docs", run=run, log=lambda msg: None)
    assert ran == ablation_commands(cfg)
    assert [c[1] for c in ran] == ["train"] * 6 + ["--threads"]
    assert all("time_budget_s=30" in c and "dtype=bfloat16" in c for c in ran[:6])
    assert f"dspark-L1={cfg.out / 'train' / 'dspark-L1' / LATEST}" in ran[-1]
    text = doc.read_text()
    assert "Written by `python scripts/ablation.py depth --budget-s 30 --limit 1 --dtype bfloat16`" in text
    assert "| dspark-L3 | 10 | 5000 | 50 |" in text and fig.is_file()


def test_reduced_run_refuses_a_folder_trained_with_other_settings(tmp_path):
    cfg = ReducedAblation("block", budget_s=30, study=tmp_path / "study", dspark="dspark")
    saved = cfg.out / "train" / block_series(1)[0].name / LATEST
    saved.mkdir(parents=True)
    (saved / "train_config.json").write_text(json.dumps({"time_budget_s": 60, "dtype": "bfloat16"}))
    with pytest.raises(DSparkError, match="time_budget_s=60"):
        run_reduced_ablation(cfg, docs=tmp_path / "docs", run=lambda cmd: pytest.fail("ran"), log=lambda m: None)


def test_ablation_rows_keep_only_the_series_drafters():
    sets = [token_dataset("gsm8k", [[1]])]
    results = aggregate([_record("dspark-L2", "gsm8k", 0, [3]), _record("other", "gsm8k", 0, [2])],
                        ["dspark-L2", "other"], sets, EvalSettings())
    rows = ablation_rows(results, depth_series())
    assert {(r["series"], r["x"], r["domain"]) for r in rows} == {("DSpark (Markov)", 2, "math"),
                                                                 ("DSpark (Markov)", 2, "overall")}
    assert ablation_rows(None, depth_series()) == []
