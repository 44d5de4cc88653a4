"""`dspark bench speed`: the summary formulas on fixed numbers, and a tiny end-to-end run (no timing assertions).

The end-to-end run uses a tiny random Llama saved as an HF folder with a word-level
tokenizer, so every row (transformers' generate / prompt lookup / assisted, and
ours) runs on it in seconds; greedy rows must equal hf-generate token for token.
"""

from __future__ import annotations

import json

import pytest
import torch

from dspark.bench.speed import CallRecord, run_speed_bench, summarise
from dspark.bench.speed_methods import Method, SpeedConfig
from dspark.bench.speed_report import render_markdown, write_outputs
from dspark.drafters.draft_lm.model import DraftLMConfig, DraftLMModel
from dspark.target.model import load_target
from tests.tiny import tiny_config, save_word_tokenizer


def _method(name: str, family: str = "ours", k: int | None = None) -> Method:
    return Method(name, family, k, lambda *a: ([], {}))


def _call(method: str, new_tokens: int, seconds: float, steps: int = 0, committed: int = 0, draft_s: float = 0.0,
          verify_s: float = 0.0, decode_s: float | None = None) -> CallRecord:
    return CallRecord(method, 1.0, "gsm8k", 0, 10, new_tokens, seconds, 1024, 0, steps, committed, draft_s,
                      verify_s, decode_s, [draft_s / max(steps, 1)] * steps, [verify_s / max(steps, 1)] * steps)


def test_summary_formulas():
    methods = [_method("hf-generate", "hf"), _method("ours-plain"), _method("ours-x", k=4)]
    records = [
        _call("hf-generate", 33, 2.0),
        # plain: 32 steps of 40 ms (t_AR = 0.04 s), decode phase 33 - 1 tokens in 1.6 s
        _call("ours-plain", 33, 1.5, steps=32, committed=32, verify_s=1.28, decode_s=1.6),
        # drafter: 8 steps, tau = 4, 10 ms draft + 70 ms verify per step, decode phase 32 tokens in 0.8 s
        _call("ours-x@k4", 33, 1.0, steps=8, committed=32, draft_s=0.08, verify_s=0.56, decode_s=0.8),
    ]
    rows = {r["method"]: r for r in summarise(records, methods, [1.0])}
    x = rows["ours-x"]
    assert x["tokens_per_s"] == pytest.approx(33.0)
    assert x["x_hf_generate"] == pytest.approx(33.0 / 16.5) and x["x_ours_plain"] == pytest.approx(1.5)
    assert x["tau"] == pytest.approx(4.0)
    assert (x["draft_ms"], x["verify_ms"]) == (pytest.approx(10.0), pytest.approx(70.0))
    assert x["ideal_speedup"] == pytest.approx(4.0 * 0.04 / 0.08)  # tau * t_AR / (t_draft + t_verify) = 2
    assert x["x_ours_plain_decode"] == pytest.approx((32 / 0.8) / (32 / 1.6))  # 2
    assert x["efficiency"] == pytest.approx(1.0)
    assert rows["ours-plain"]["ideal_speedup"] == pytest.approx(1.0)
    assert "ideal_speedup" not in rows["hf-generate"]


def _tiny_hf_target(folder):
    """A sharp tiny random Llama (no near-ties in greedy argmax) with a word-level tokenizer.

    English prompts become [UNK] runs; with seed 0 the greedy continuation never hits token 94, so making
    that the stop token gives full-length greedy outputs.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_config(eos_token_id=94)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(folder, safe_serialization=True)
    save_word_tokenizer(folder, cfg["vocab_size"])
    return load_target(str(folder))


def test_tiny_end_to_end_greedy_rows_equal_hf_generate(tmp_path):
    target = _tiny_hf_target(tmp_path / "target")
    DraftLMModel.from_target(target, DraftLMConfig(num_layers=2, block_size=3)).save_checkpoint(tmp_path / "dlm")
    cfg = SpeedConfig(target=str(tmp_path / "target"), sets=["gsm8k", "mt-bench"], per_set=1, max_new_tokens=12,
                      temperatures=[0.0, 1.0], draft_lm=str(tmp_path / "dlm"), warmup_tokens=2,
                      max_prompt_tokens=400)
    result = run_speed_bench(cfg, "dspark bench speed --test", log=lambda msg: None)
    rows = result["rows"]
    names = {r["key"] for r in rows}
    assert names == {"hf-generate", "hf-prompt-lookup@k7", "hf-assisted@k3", "ours-plain", "ours-prompt-lookup@k7",
                     "ours-draft-lm@k3"}
    for r in rows:
        assert r["prompts"] == 2 and r["tokens_per_s"] > 0
        if r["temperature"] == 0:
            assert r["new_tokens"] == 24  # full length: the comparison covers 12 tokens per prompt
            # each row against its plain decoding (hf-generate is the reference of transformers' rows and ours-plain)
            assert r["greedy_match"] == (None if r["key"] == "hf-generate" else [2, 2]), (r["key"], r["mismatches"])
        if r["family"] == "ours":
            assert r["tau"] >= 1.0 and r["ideal_speedup"] > 0
    paths = write_outputs(result, tmp_path / "out", str(tmp_path / "performance.md"))
    doc = (tmp_path / "performance.md").read_text()
    assert "dspark bench speed --test" in doc and "| ours-draft-lm | 3 |" in doc and "ideal ×" in doc
    assert "| method | GSM8K | MT-Bench |" in doc and "| hf-generate | 1.00 | 1.00 |" in doc  # per-set ratios
    again = render_markdown(json.loads(paths[0].read_text()))  # --from-json renders the same tables
    assert again == (tmp_path / "out" / "speed.md").read_text()


def test_compile_twins_are_timed_in_the_same_run_and_stay_lossless(tmp_path):
    from dspark.drafters.dspark.drafter import save_dspark_checkpoint
    from tests.drafters.tiny_drafters import tiny_dspark

    target = _tiny_hf_target(tmp_path / "target")
    save_dspark_checkpoint(tiny_dspark(target), tmp_path / "ds")
    del target
    cfg = SpeedConfig(target=str(tmp_path / "target"), sets=["gsm8k"], per_set=2, max_new_tokens=8,
                      temperatures=[0.0], warmup_tokens=2, max_prompt_tokens=400, include_hf=False, compile=True,
                      drafters=[["ds", str(tmp_path / "ds")]], policy="fixed:1")
    result = run_speed_bench(cfg, "dspark bench speed --compile", log=lambda msg: None)
    rows = {r["key"]: r for r in result["rows"]}
    assert set(rows) == {"ours-plain", "ours-prompt-lookup@k7", "ours-ds/fixed:1@k4", "ours-plain+compile",
                         "ours-ds/fixed:1+compile@k4"}
    assert rows["ours-plain+compile"]["greedy_match"] == [2, 2]  # against ours-plain (no HF rows)
    # a drafter's compiled twin verifies as its row does
    assert rows["ours-ds/fixed:1+compile@k4"]["verified_per_step"] <= 2.0
    assert rows["ours-ds/fixed:1+compile@k4"]["greedy_match"] == [2, 2]
    assert "torch.compile'd target" in render_markdown(result)


def test_cheaper_drafting_variants_get_their_own_rows(tmp_path):
    from dspark.drafters.draft_vocab import save_draft_vocab
    from dspark.drafters.dspark.drafter import save_dspark_checkpoint
    from tests.drafters.tiny_drafters import tiny_dspark

    target = _tiny_hf_target(tmp_path / "target")
    save_dspark_checkpoint(tiny_dspark(target), tmp_path / "ds")
    vocab = save_draft_vocab(tmp_path / "v.json", list(range(0, 96, 2)), 96, 1.0, "test")
    cfg = SpeedConfig(target=str(tmp_path / "target"), sets=["gsm8k"], per_set=1, max_new_tokens=8,
                      temperatures=[0.0], warmup_tokens=2, max_prompt_tokens=400, include_hf=False,
                      drafters=[["ds", str(tmp_path / "ds")]], head_top_m=[3], draft_vocab=str(vocab))
    rows = {r["key"]: r for r in run_speed_bench(cfg, "t", log=lambda msg: None)["rows"]}
    assert {"ours-ds@k4", "ours-ds-top3@k4", "ours-ds-top3-vocab48@k4"} <= set(rows)
    assert all(r["greedy_match"] == [1, 1] for k, r in rows.items() if k != "ours-plain")
    assert rows["ours-plain"]["greedy_match"] is None  # its reference, hf-generate, was not run
    assert "top 3" in rows["ours-ds-top3-vocab48@k4"]["note"]


def test_an_eagle3_drafter_gets_a_row_without_dspark_variants(tmp_path):
    """An Eagle3 drafter (which has a draft_vocab attribute too) is timed as it is: the --head-top-m and
    --draft-vocab variant rows are DSpark/DFlash loading options."""
    from tests.drafters.tiny_drafters import tiny_eagle3

    target = _tiny_hf_target(tmp_path / "target")
    tiny_eagle3(target, target_layer_ids=[0, 2, 3]).save_checkpoint(tmp_path / "e3")
    cfg = SpeedConfig(target=str(tmp_path / "target"), sets=["gsm8k"], per_set=1, max_new_tokens=8,
                      temperatures=[0.0], warmup_tokens=2, max_prompt_tokens=400, include_hf=False,
                      drafters=[["e3", str(tmp_path / "e3")]], head_top_m=[3])
    rows = {r["key"]: r for r in run_speed_bench(cfg, "t", log=lambda msg: None)["rows"]}
    assert {k for k in rows if k.startswith("ours-e3")} == {"ours-e3@k3"}
    assert rows["ours-e3@k3"]["greedy_match"] == [1, 1]


def test_hybrid_rows_and_jsonl_prompt_sets(tmp_path):
    from dspark.drafters.dspark.drafter import save_dspark_checkpoint
    from tests.drafters.tiny_drafters import tiny_dspark

    target = _tiny_hf_target(tmp_path / "target")
    save_dspark_checkpoint(tiny_dspark(target), tmp_path / "ds")
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"turns": ["the cat sat on the mat and the cat sat on the mat and the cat"]}) + "\n")
    cfg = SpeedConfig(target=str(tmp_path / "target"), sets=[], jsonl=[["mine", str(own)]], per_set=1,
                      max_new_tokens=8, temperatures=[0.0], warmup_tokens=2, max_prompt_tokens=400, include_hf=False,
                      drafters=[["ds", str(tmp_path / "ds")]], hybrid=True, hybrid_min_ngram=2)
    result = run_speed_bench(cfg, "t", log=lambda msg: None)
    rows = {r["key"]: r for r in result["rows"]}
    assert {"ours-ds@k4", "ours-ds+hybrid@k4"} <= set(rows)
    # the hybrid is lossless too
    assert all(r["greedy_match"] == [1, 1] for k, r in rows.items() if k != "ours-plain")
    assert "prompt lookup where the context repeats a 2-gram" in rows["ours-ds+hybrid@k4"]["note"]
    assert {p["dataset"] for p in result["prompts"]} == {"mine"}


def test_policy_rows_verify_as_the_policy_plans_and_stay_lossless(tmp_path):
    """--policy: the --drafter rows (hybrid included) verify as the policy plans, alg1 on the drafter's step cost
    profiled at the start and its sts.json; their names carry the policy; prompt lookup and plain verify all."""
    from dspark.drafters.dspark.drafter import save_dspark_checkpoint
    from tests.drafters.tiny_drafters import tiny_dspark

    target = _tiny_hf_target(tmp_path / "target")
    drafter = tiny_dspark(target)
    save_dspark_checkpoint(drafter, tmp_path / "ds")
    (tmp_path / "ds" / "sts.json").write_text(json.dumps({"temperatures": [1.0] * drafter.block_size}))

    def rows_for(policy: str) -> dict:
        cfg = SpeedConfig(target=str(tmp_path / "target"), sets=["gsm8k", "mt-bench"], per_set=1, max_new_tokens=10,
                          temperatures=[0.0], warmup_tokens=2, max_prompt_tokens=400, include_hf=False,
                          drafters=[["ds", str(tmp_path / "ds")]], hybrid=True, policy=policy)
        return {r["key"]: r for r in run_speed_bench(cfg, "t", log=lambda msg: None)["rows"]}

    rows = rows_for("alg1")
    assert {"ours-plain", "ours-prompt-lookup@k7", "ours-ds/alg1@k4", "ours-ds+hybrid/alg1@k4"} == set(rows)
    assert all(r["greedy_match"] == [2, 2] for k, r in rows.items() if k != "ours-plain")
    assert "alg1 plans on the step's cost profiled" in rows["ours-ds/alg1@k4"]["note"]
    assert "STS from its sts.json" in rows["ours-ds+hybrid/alg1@k4"]["note"]
    # fixed:1 verifies the anchor and at most one draft a step (fewer where the answer's end caps the drafts), where
    # verifying all carries the anchor and up to 4 drafts
    rows = rows_for("fixed:1")
    assert 1.5 < rows["ours-ds/fixed:1@k4"]["verified_per_step"] <= 2.0
    assert rows["ours-ds/fixed:1@k4"]["greedy_match"] == [2, 2] and "profiled" not in rows["ours-ds/fixed:1@k4"]["note"]
    assert rows_for("all")["ours-ds@k4"]["verified_per_step"] > 3.5


def test_a_bad_policy_fails_before_anything_loads(capsys):
    from dspark.cli import main

    assert main(["bench", "speed", "--policy", "fastest", "--target", "no-such-model"]) != 0
    err = capsys.readouterr().err
    assert "unknown policy 'fastest'" in err and "Traceback" not in err
