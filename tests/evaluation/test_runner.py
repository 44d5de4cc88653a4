"""Evaluation datasets, the runner (resume, macro averages, confidence metrics) and the threshold sweep.

Models: the tiny random target of tests/tiny.py (no tokenizer, token-id
prompts) and ``OracleConfidenceDrafter`` below, whose confidence logits are
``inflate`` times the logit of each draft's true acceptance probability.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.drafters.prompt_lookup import PromptLookupDrafter
from dspark.errors import DSparkError
from dspark.data.eval_sets import (
    DEFAULT_SEED,
    EVAL_CAPS,
    DatasetError,
    heldout_dataset,
    load_eval_dataset,
    load_jsonl_dataset,
    parse_dataset_names,
    read_first_turns,
    token_dataset,
)
from dspark.evaluation.runner import EvalSettings, aggregate, evaluate, read_records
from dspark.evaluation.sweep import parse_thresholds, sweep_rows, sweep_thresholds
from dspark.generation.stats import AcceptanceStats
from dspark.sampling.processing import logits_to_probs, sample_from_probs
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import StaticThreshold
from tests.tiny import tiny_target

VOCAB = 96  # tests/tiny.py


class OracleConfidenceDrafter:
    """Drafts from the target's own distribution flattened by ``flatten`` (< 1), one target pass per draft.

    Rejection sampling accepts draft x_k, given drafts < k accepted, with
    probability min(1, target_probs[x_k] / draft_probs[x_k]); the confidence
    logit is ``inflate`` times the logit of exactly that, so ``inflate`` > 1 is
    an over-confident head whose ideal STS temperature is ``inflate``.
    """

    target_layer_ids = None

    def __init__(self, target, block_size: int = 4, flatten: float = 0.5, inflate: float = 2.0) -> None:
        self.target, self.block_size, self.flatten, self.inflate = target, block_size, flatten, inflate

    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        R, K, V = len(requests), max(max_tokens), self.target.vocab_size
        tokens = torch.zeros(R, K, dtype=torch.long)  # (R, K)
        draft_probs = torch.zeros(R, K, V)  # (R, K, V)
        conf = torch.zeros(R, K)  # (R, K)
        for r, req in enumerate(requests):
            context = list(req.tokens)
            for k in range(max_tokens[r]):
                ids = torch.tensor(context, dtype=torch.long)
                logits = self.target.forward(ids, [len(context)], None, logits_for="last").logits[0]  # (V,)
                t = req.sampling.temperature
                target_probs = logits_to_probs(logits, t)
                probs = logits_to_probs(logits * self.flatten, t)
                x = int(sample_from_probs(probs, req.generator))
                accept = min(1.0, float(target_probs[x] / probs[x]))
                accept = min(max(accept, 1e-3), 1 - 1e-3)  # sigmoid(inflate * logit) stays < 1 in float32
                tokens[r, k], draft_probs[r, k] = x, probs
                conf[r, k] = self.inflate * math.log(accept / (1 - accept))
                context.append(x)
        return DraftBlock(tokens, torch.tensor(max_tokens, dtype=torch.long), draft_probs, conf)


def without_timing(results: dict) -> dict:
    """Results minus wall-clock seconds (the only field a rerun may change)."""
    out = json.loads(json.dumps(results))
    for res in out["drafters"].values():
        for bench in res["benchmarks"].values():
            bench.pop("seconds", None)
    return out


def random_prompts(n: int, length: int = 10, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


# --------------------------------------------------------------------------- datasets


def test_caps_shuffle_and_limit_are_deterministic():
    gsm = load_eval_dataset("gsm8k")  # 1319 rows, cap 500: shuffled, truncated
    assert len(gsm) == EVAL_CAPS["gsm8k"] == 500
    assert [s.row for s in gsm.samples] == [s.row for s in load_eval_dataset("gsm8k").samples]
    assert [s.row for s in gsm.samples] != list(range(500))
    other = load_eval_dataset("gsm8k", seed=1)
    assert [s.row for s in other.samples] != [s.row for s in gsm.samples]
    assert all(s.seed == DEFAULT_SEED + s.idx for s in gsm.samples)
    # --limit cuts the same shuffle: a prefix of the full selection
    limited = load_eval_dataset("gsm8k", limit=7)
    assert [s.row for s in limited.samples] == [s.row for s in gsm.samples[:7]]
    # a set within its cap keeps file order; with a smaller limit it is shuffled first
    mt = load_eval_dataset("mt-bench")
    assert len(mt) == 80 and [s.row for s in mt.samples] == list(range(80))
    assert [s.row for s in load_eval_dataset("mt-bench", limit=5).samples] != list(range(5))
    assert len(load_eval_dataset("aime25")) == 30 and mt.domain == "chat" and gsm.domain == "math"
    assert isinstance(gsm.samples[0].prompt, str) and "boxed" in gsm.samples[0].prompt


def test_heldout_rows_are_disjoint_from_evaluated_rows():
    evaluated = load_eval_dataset("gsm8k")
    held = heldout_dataset("gsm8k")
    assert len(held) > 700  # 1319 - 500, minus duplicated questions
    assert not {s.row for s in held.samples} & {s.row for s in evaluated.samples}
    assert not {s.prompt for s in held.samples} & {s.prompt for s in evaluated.samples}
    assert min(s.idx for s in held.samples) >= 500  # decoding seeds never repeat an evaluated sample's
    assert [s.row for s in heldout_dataset("gsm8k", limit=3).samples] == [s.row for s in held.samples[:3]]
    with pytest.raises(DatasetError, match="no held-out rows"):
        heldout_dataset("mt-bench")


def test_jsonl_reading_and_names(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"turns": ["first", "second"]}\n\n{"turns": ["again"]}\n')
    assert read_first_turns(path) == ["first", "again"]
    ds = load_jsonl_dataset(path)
    assert ds.name == "mine" and ds.domain == "custom" and [s.prompt for s in ds.samples] == ["first", "again"]
    assert load_jsonl_dataset(path, name="alpaca-substitute").domain == "chat"
    (tmp_path / "bad.jsonl").write_text('{"turns": []}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:1"):
        read_first_turns(tmp_path / "bad.jsonl")
    assert parse_dataset_names("math,mt-bench") == ["gsm8k", "math500", "aime25", "mt-bench"]
    assert len(parse_dataset_names("all")) == 8
    with pytest.raises(DatasetError, match="unknown dataset"):
        parse_dataset_names("alpacca")


# --------------------------------------------------------------------------- aggregation


def _record(drafter: str, dataset: str, idx: int, taus: list[int], block_size: int = 4) -> dict:
    stats = AcceptanceStats(block_size)
    for tau in taus:  # every step verifies all drafts and accepts tau - 1
        stats.add_step(block_size, tau - 1, tau)
    return {"drafter": drafter, "dataset": dataset, "idx": idx, "row": idx, "seed": DEFAULT_SEED + idx,
            "new_tokens": sum(taus), "seconds": 0.0, "stats": stats.to_dict()}


def test_macro_averages_weigh_benchmarks_then_domains_equally():
    sets = [token_dataset(n, [[1]] * 2) for n in ("gsm8k", "math500", "mbpp")]
    records = [
        _record("d", "gsm8k", 0, [3, 3]), _record("d", "gsm8k", 1, [3, 3, 3, 3]),  # tau 3
        _record("d", "math500", 0, [5]), _record("d", "math500", 1, [5]),  # tau 5
        _record("d", "mbpp", 0, [1, 3]), _record("d", "mbpp", 1, [2]),  # pooled: 6 / 3 = 2
        _record("d", "mbpp", 7, [5, 5]),  # not in the selection: ignored
    ]
    res = aggregate(records, ["d"], sets, EvalSettings())
    d = res["drafters"]["d"]
    assert d["benchmarks"]["mbpp"]["acceptance_length"] == pytest.approx(2.0)
    assert d["domains"]["math"]["acceptance_length"] == pytest.approx(4.0)  # (3 + 5) / 2, not pooled 3.67
    assert d["domains"]["code"]["acceptance_length"] == pytest.approx(2.0)
    assert d["overall"]["acceptance_length"] == pytest.approx(3.0)  # (4 + 2) / 2 over domains
    assert d["overall"]["benchmark_mean"] == pytest.approx(10 / 3)  # (3 + 5 + 2) / 3 over benchmarks
    assert list(res["domains"]) == ["math", "code"]
    assert "domain" in res["definitions"] and "overall" in res["definitions"]
    json.dumps(res, allow_nan=False)


# --------------------------------------------------------------------------- runner


def test_evaluate_writes_outputs_and_resumes(tmp_path):
    target = tiny_target()
    sets = [token_dataset("gsm8k", random_prompts(2)), token_dataset("mt-bench", [[5, 6, 7, 5, 6, 7, 5, 6]])]
    drafters = {"pld": PromptLookupDrafter(VOCAB, 4)}
    res = evaluate(target, drafters, sets, max_new_tokens=16, out_dir=tmp_path, progress=False)
    for name in ("results.json", "results.md", "run.json", "samples.jsonl", "acceptance_math.png"):
        assert (tmp_path / name).is_file(), name
    assert len(read_records(tmp_path / "samples.jsonl")) == 3
    assert res["drafters"]["pld"]["benchmarks"]["gsm8k"]["num_samples"] == 2
    assert "| pld |" in (tmp_path / "results.md").read_text()
    # resume: nothing is decoded again, the results are the same
    again = evaluate(target, drafters, sets, max_new_tokens=16, out_dir=tmp_path, progress=False)
    assert len(read_records(tmp_path / "samples.jsonl")) == 3 and again == res  # records reread, not rerun
    # a torn last line (killed run) is dropped and that sample reruns
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    (tmp_path / "samples.jsonl").write_text("\n".join(lines[:2] + [lines[2][:20]]) + "\n")
    rerun = evaluate(target, drafters, sets, max_new_tokens=16, out_dir=tmp_path, progress=False)
    assert len(read_records(tmp_path / "samples.jsonl")) == 3
    assert without_timing(rerun) == without_timing(res)  # same seed, same sample
    # other settings into the same folder are refused
    with pytest.raises(DSparkError, match="other settings"):
        evaluate(target, drafters, sets, max_new_tokens=17, out_dir=tmp_path, progress=False)


def test_confidence_policy_adapter():
    block = DraftBlock(torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 2]), torch.zeros(2, 3, 5),
                       torch.tensor([[2.0, -2.0, 2.0], [2.0, 2.0, 0.0]]))
    policy = ConfidenceAdapter(StaticThreshold(0.5))
    assert policy.verify_len(block).tolist() == [1, 2]  # cut at the first sigmoid < 0.5, padding ignored
    flat = ConfidenceAdapter(StaticThreshold(0.85), sts_temperatures=[4.0, 4.0, 4.0])  # sigmoid(0.5) = 0.62 < 0.85
    assert flat.verify_len(block).tolist() == [0, 0]
    no_conf = DraftBlock(block.tokens, block.num_tokens, block.draft_probs, vocab=block.vocab)
    assert policy.verify_len(no_conf).tolist() == [3, 2]  # no confidence head: verify everything
    with pytest.raises(DSparkError, match="confidence head"):
        ConfidenceAdapter(StaticThreshold(0.5), fallback_confidence=None).verify_len(no_conf)


def test_confidence_metrics_and_threshold_sweep(tmp_path):
    target = tiny_target()
    sets = [token_dataset("gsm8k", random_prompts(2, seed=1)), token_dataset("mt-bench", random_prompts(2, seed=2))]
    drafter = OracleConfidenceDrafter(target, block_size=4, inflate=2.0)
    res = evaluate(target, {"oracle": drafter}, sets, max_new_tokens=20, out_dir=tmp_path / "eval",
                   temperatures={"oracle": [2.0] * 4}, progress=False)
    bench = res["drafters"]["oracle"]["benchmarks"]["gsm8k"]
    conf = bench["confidence"]
    # one prediction per verified draft position; every proposed draft is verified without a policy
    assert conf["raw"]["count"] == bench["num_proposed"] > 0 and len(conf["raw"]["per_position"]) == 4
    assert conf["sts"]["count"] == conf["raw"]["count"] and conf["temperatures"] == [2.0] * 4
    assert conf["sts"]["per_position"][0]["auroc"] == pytest.approx(conf["raw"]["per_position"][0]["auroc"])
    assert "Confidence head" in (tmp_path / "eval" / "results.md").read_text()

    rows = sweep_thresholds(target, drafter, sets, [0.0, 0.5, 1.0], tmp_path / "sweep", name="oracle",
                            max_new_tokens=20, progress=False)
    for name in ("sweep.json", "sweep.md", "sweep.png", "threshold-0.5/results.json"):
        assert (tmp_path / "sweep" / name).is_file(), name
    by = {(r["domain"], r["threshold"]): r for r in rows}
    for domain in ("math", "chat"):
        assert by[domain, 0.0]["verified_per_step"] > by[domain, 0.5]["verified_per_step"] > 0
        assert by[domain, 1.0]["verified_per_step"] == 0  # sigmoid never reaches 1: nothing verified
        # a calibrated-enough head keeps the likelier drafts (negative control: threshold 0)
        assert by[domain, 0.5]["acceptance_rate"] > by[domain, 0.0]["acceptance_rate"]
    # threshold 0 verifies every draft: the same numbers as the plain evaluation
    plain = res["drafters"]["oracle"]["benchmarks"]["gsm8k"]
    swept = json.loads((tmp_path / "sweep" / "threshold-0" / "results.json").read_text())
    assert swept["drafters"]["oracle"]["benchmarks"]["gsm8k"]["stats"] == plain["stats"]

    with pytest.raises(DSparkError, match="confidence head"):
        sweep_thresholds(target, PromptLookupDrafter(VOCAB, 4), sets[:1], [0.0], tmp_path / "pld", name="pld",
                         max_new_tokens=8, progress=False)


def test_sweep_rows_pool_the_domain():
    stats_a, stats_b = AcceptanceStats(4), AcceptanceStats(4)
    stats_a.add_step(4, 2, 3)  # verified 4, accepted 2
    stats_a.add_step(2, 2, 3)  # verified 2, accepted 2
    stats_b.add_step(0, 0, 1)  # threshold cut everything
    results = {
        "domains": {"math": ["gsm8k", "math500"]},
        "drafters": {"x": {"benchmarks": {"gsm8k": {"stats": stats_a.to_dict()},
                                          "math500": {"stats": stats_b.to_dict()}}}},
    }
    (row,) = sweep_rows(results, 0.3, "x")
    assert row["num_steps"] == 3 and row["threshold"] == 0.3 and row["domain"] == "math"
    assert row["verified_per_step"] == pytest.approx(6 / 3)
    assert row["accepted_per_step"] == pytest.approx(4 / 3)
    assert row["rejected_per_step"] == pytest.approx(2 / 3)
    assert row["acceptance_rate"] == pytest.approx(4 / 6)
    assert row["acceptance_length"] == pytest.approx(7 / 3)
    assert parse_thresholds("0.5, 0,0.5") == [0.0, 0.5]
    with pytest.raises(DSparkError):
        parse_thresholds("0,1.5")
