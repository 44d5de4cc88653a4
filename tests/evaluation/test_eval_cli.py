"""`dspark eval`, `dspark calibrate` end to end and the `dspark reproduce` orchestration.

The target is a tiny random Llama (2 layers, hidden 32) with the real SmolLM2
tokenizer and chat template, so text prompts go through the same path as with
the real model; skipped when the SmolLM2 preset is not installed.
"""

from __future__ import annotations

import json

import pytest

from dspark.cli import main
from dspark.errors import DSparkError
from dspark.scheduler.sts import load_sts_json
from dspark.data.eval_sets import token_dataset
from dspark.evaluation.runner import EvalSettings, aggregate, read_records
from tests.evaluation.test_runner import OracleConfidenceDrafter, _record
from tests.tiny import save_chat_target


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny random HF Llama folder carrying SmolLM2's tokenizer (vocabulary 49,152)."""
    return save_chat_target(tmp_path_factory.mktemp("tiny-smollm2"), hidden_size=32, num_hidden_layers=2)[0]


def test_eval_end_to_end_and_resume(chat_target, tmp_path, capsys):
    prompts = tmp_path / "three.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in
                                 ["Say hello hello hello.", "Count to five.", "Name a colour."]) + "\n")
    out = tmp_path / "eval"

    def argv(max_new_tokens: int = 12) -> list[str]:
        return ["eval", "--target", str(chat_target), "--drafter", "pld=prompt-lookup", "--jsonl", str(prompts),
                "--datasets", "mt-bench", "--limit", "3", "--max-new-tokens", str(max_new_tokens), "--out", str(out),
                "--no-progress"]

    assert main(argv()) == 0
    for name in ("results.json", "results.md", "samples.jsonl", "acceptance_chat.png", "acceptance_custom.png"):
        assert (out / name).is_file(), name
    results = json.loads((out / "results.json").read_text())
    assert [(d["name"], d["domain"], d["num_samples"]) for d in results["datasets"]] == [
        ("mt-bench", "chat", 3), ("three", "custom", 3)]
    pld = results["drafters"]["pld"]
    assert pld["spec"] == "prompt-lookup" and pld["benchmarks"]["three"]["num_steps"] >= 3
    assert pld["overall"]["acceptance_length"] == pytest.approx(
        (pld["domains"]["chat"]["acceptance_length"] + pld["domains"]["custom"]["acceptance_length"]) / 2)
    assert "| pld |" in capsys.readouterr().out
    # resume: a rerun decodes nothing new
    assert main(argv()) == 0 and len(read_records(out / "samples.jsonl")) == 6
    # other settings into the same folder: a clear error, exit status 2
    assert main(argv(max_new_tokens=13)) == 2
    assert "other settings" in capsys.readouterr().err


def test_calibrate_end_to_end(chat_target, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dspark.drafters.registry.load_drafter",
                        lambda spec, target, block_size=None, head_top_m=None, draft_vocab=None: OracleConfidenceDrafter(target, block_size=3))
    out = tmp_path / "cal"

    def argv(datasets: str = "gsm8k") -> list[str]:
        return ["calibrate", "--target", str(chat_target), "--drafter", "some/ckpt", "--datasets", datasets,
                "--limit", "3", "--max-new-tokens", "12", "--out", str(out), "--no-progress"]

    assert main(argv()) == 0
    temperatures = load_sts_json(out / "sts.json", block_size=3)  # SGLang STS format, gamma = 3 entries
    report = json.loads((out / "calibration.json").read_text())
    assert report["drafter"] == "ckpt" and report["num_prompts"] == 3 and report["temperatures"] == temperatures
    assert "beyond the evaluation caps" in report["heldout"]
    assert len(report["before"]["per_position"]) == len(report["after"]["per_position"]) == 3
    # position 1 is fitted first over a grid that contains T = 1: in-sample ECE cannot get worse
    assert report["after"]["per_position"][0]["ece"] <= report["before"]["per_position"][0]["ece"] + 1e-12
    assert (out / "reliability.png").is_file() and "ECE before" in (out / "calibration.md").read_text()
    shards = sorted((out / "shards").glob("*.pt"))
    assert len(shards) == 3 and all(s.name.startswith("gsm8k-") for s in shards)
    # rerun: shards are reused, the fit is identical
    stamps = [s.stat().st_mtime_ns for s in shards]
    assert main(argv()) == 0
    assert [s.stat().st_mtime_ns for s in shards] == stamps and load_sts_json(out / "sts.json", 3) == temperatures
    capsys.readouterr()
    # mt-bench is evaluated in full: no held-out rows
    assert main(argv("mt-bench")) == 2
    assert "no held-out rows" in capsys.readouterr().err


# --------------------------------------------------------------------------- reproduce


def test_reproduce_dry_run_lists_the_chain(tmp_path, capsys):
    out = tmp_path / "rp"
    assert main(["reproduce", "--budget", "tiny", "--out", str(out), "--ablations", "--dry-run"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[todo]")]
    commands = [l.removeprefix("[todo] dspark ").split()[:2] for l in lines]
    assert commands[:3] == [["data", "prompts"], ["data", "regenerate"], ["data", "tokenize"]]
    assert [c[0] for c in commands[3:7]] == ["train"] * 4
    assert commands[7:11] == [["calibrate", "--target"]] * 2 + [["eval", "--target"]] * 2
    assert sum(c[0] == "train" for c in commands) == 4 + 6 + 12  # main, depth 1-5 + DFlash, 3 x 4 block sizes
    assert not out.exists()  # a dry run writes nothing


def test_reproduce_plan_parses_and_runs_resumably(tmp_path, monkeypatch):
    from dspark.studies import reproduce

    steps = reproduce.plan(reproduce.BUDGETS["tiny"], tmp_path, "smollm2-135m", ablations=True)
    # our own commands and the training configs (preset + --set) are valid today
    mine = [s for s in steps if s.stage != "data"]
    assert reproduce.check_commands(mine) == []
    bogus = reproduce.Step("bogus", "eval", ["eval", "--no-such-flag"])
    assert "does not parse" in reproduce.check_commands([bogus])[0]
    bad_key = reproduce.Step("bad", "train", ["train", "--config", "smollm2-dflash", "--set", "model.nope=1"])
    assert "nope" in reproduce.check_commands([bad_key])[0]

    monkeypatch.setattr(reproduce, "check_commands", lambda steps: [])
    calls = []
    assert reproduce.run_plan(steps, tmp_path, runner=lambda argv: calls.append(list(argv)) or 0,
                              log=lambda msg: None) == [s.name for s in steps]
    assert calls == [s.argv for s in steps]
    assert reproduce.run_plan(steps, tmp_path, runner=lambda argv: 1 / 0, log=lambda msg: None) == []  # all done
    (tmp_path / ".done" / "eval").unlink()
    with pytest.raises(DSparkError, match="step eval failed"):
        reproduce.run_plan(steps, tmp_path, runner=lambda argv: 3, log=lambda msg: None)


def test_reproduce_writes_docs_from_results(tmp_path):
    from dspark.studies import reproduce

    out, budget = tmp_path / "rp", reproduce.BUDGETS["tiny"]
    sets = [token_dataset(n, [[1]]) for n in ("gsm8k", "mbpp", "mt-bench")]
    records = [_record(d, s.name, 0, [tau, tau]) for d, tau in (("dflash", 2), ("dspark-markov", 3)) for s in sets]
    main_results = aggregate(records, ["dflash", "dspark-markov"], sets, EvalSettings(target="smollm2-135m"))
    (out / "eval").mkdir(parents=True)
    (out / "eval" / "results.json").write_text(json.dumps(main_results))
    depth = aggregate([_record(f"dspark-L{d}", s.name, 0, [d + 1]) for d in (1, 2) for s in sets],
                      ["dspark-L1", "dspark-L2"], sets, EvalSettings())
    (out / "ablations" / "depth" / "eval").mkdir(parents=True)
    (out / "ablations" / "depth" / "eval" / "results.json").write_text(json.dumps(depth))
    summary = {"ece_mean": 0.05, "auc_mean": 0.8, "brier_mean": 0.2, "count": 10, "per_position": []}
    (out / "calibrate" / "dspark-markov").mkdir(parents=True)
    (out / "calibrate" / "dspark-markov" / "calibration.json").write_text(json.dumps(
        {"heldout": "rows beyond the caps", "num_steps": 10, "temperatures": [1.5, 2.0],
         "before": summary, "after": {**summary, "ece_mean": 0.01}}))

    docs = reproduce.write_docs(out, budget, tmp_path / "docs" / "results.md", "dspark reproduce --budget tiny")
    text = docs.read_text()
    assert "dspark reproduce --budget tiny" in text and "| eval_limit | 2 |" in text
    assert "| dspark-markov | **3.00** | **3.00** | **3.00** |" in text  # Table 1 row, best in bold
    assert "STS calibration: dspark-markov" in text and "0.0100" in text
    assert "Drafter depth" in text and (tmp_path / "docs" / "figures" / "ablation_depth.png").is_file()
    assert "](figures/ablation_depth.png)" in text


def test_reproduce_with_existing_data_caches_features_once(tmp_path):
    from dspark.studies.reproduce import BUDGETS, check_commands, plan

    steps = plan(BUDGETS["cpu"], tmp_path / "study", "smollm2-135m", data_dir=tmp_path / "tok")
    names = [s.name for s in steps]
    assert "regenerate" not in names and "tokenize" not in names
    assert names.index("features") < min(i for i, n in enumerate(names) if n.startswith("train-"))
    trains = [s for s in steps if s.name.startswith("train-")]
    assert len(trains) == 4
    for s in trains:  # every drafter reads the same cache, under the same time budget
        assert f"cache_dir={tmp_path / 'study' / 'data' / 'features'}" in s.argv
        assert "feature_source=cache" in s.argv and "time_budget_s=540" in s.argv
    assert check_commands(steps) == []
