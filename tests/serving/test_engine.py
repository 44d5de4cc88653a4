"""Continuous-batching engine: exactness under batching/rollback, seeds, queue, cancellation, policies."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.drafters.draft_lm.drafter import DraftModelDrafter
from dspark.drafters.prompt_lookup import PromptLookupDrafter
from dspark.errors import PromptError
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.scheduler.sps import SPSTable
from dspark.serving.engine import Engine, EngineClosedError, EngineConfig, QueueFullError
from dspark.scheduler.adapter import make_policy, parse_policy
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import PolicyError
from tests.tiny import tiny_target

GAMMA = 4
POLICIES = ["all", "fixed:0", "fixed:1", "fixed:3", "threshold:0.5", "alg1", "async"]
# a table on which extra verify tokens cost throughput, so alg1/async really trim
SPS = SPSTable((1, 3, 6, 10, 16), (1.0, 0.8, 0.6, 0.45, 0.3), 64)


class ConfidentDraftModel(DraftModelDrafter):
    """A random draft LM plus a causal toy confidence head: logit_k reads the previous token only."""

    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        block = super().propose(requests, max_tokens)
        anchors = torch.tensor([r.anchor for r in requests], dtype=torch.long)[:, None]  # (R, 1)
        prev = torch.cat([anchors, block.tokens[:, :-1]], dim=1)  # (R, K) x_{k-1}
        block.confidence_logits = ((prev * 7) % 5).float() - 1.5  # (R, K) in [-1.5, 2.5]
        return block


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


@pytest.fixture(scope="module")
def drafter(target):
    return ConfidentDraftModel(tiny_target(seed=1).model, target.vocab_size, GAMMA)


PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 10, 11], [20, 21], [30, 31, 32, 33, 34]]
MAX_NEW = [24, 9, 31, 17, 5]


def _plain(target, prompt, sampling):
    return SpeculativeGenerator(target).generate([prompt], sampling)[0].output_ids


def _wait_first_tokens(handle):
    event = next(handle.events(timeout=30))
    return list(event.token_ids), event


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_plain_under_continuous_batching(target, drafter, policy):
    sampling = [SamplingParams(0.0, max_new_tokens=m) for m in MAX_NEW]
    expected = [_plain(target, p, s) for p, s in zip(PROMPTS, sampling)]
    with Engine(target, drafter, make_policy(policy, SPS), EngineConfig(max_batch=3, max_queue=8)) as engine:
        early = [engine.submit(PROMPTS[i], sampling[i]) for i in range(2)]
        first, event = _wait_first_tokens(early[0])  # later requests join a batch already decoding
        late = [engine.submit(PROMPTS[i], sampling[i]) for i in range(2, 5)]
        rest, reason = early[0].result(30) if not event.finished else ([], event.finish_reason)
        outputs = [first + rest] + [h.result(30)[0] for h in early[1:] + late]
        stats = engine.stats()
    assert outputs == expected
    assert stats.requests.get("length", 0) + stats.requests.get("stop", 0) == 5
    assert stats.batch_size == 0 and stats.queue_depth == 0
    if policy == "fixed:0":
        assert stats.verified_tokens == 0
    if policy == "fixed:1":
        assert stats.verified_tokens <= stats.request_steps
    assert stats.steps > 0 and stats.avg_acceptance_length >= 1.0


def test_policies_change_verify_lengths(target, drafter):
    """Negative control for the test above: the policies really verify different numbers of drafts."""
    verify = {}
    for policy in ("all", "threshold:0.5", "alg1"):
        with Engine(target, drafter, make_policy(policy, SPS), EngineConfig(max_batch=4)) as engine:
            handles = [engine.submit(p, SamplingParams(0.0, max_new_tokens=m)) for p, m in zip(PROMPTS, MAX_NEW)]
            for h in handles:
                h.result(30)
            verify[policy] = engine.stats().avg_verify_len
    assert verify["threshold:0.5"] < verify["all"]
    assert verify["alg1"] < verify["all"]


@pytest.mark.parametrize("policy", ["all", "fixed:2", "threshold:0.5"])
def test_seed_reproduces_sample_regardless_of_batch(target, drafter, policy):
    probe = SamplingParams(1.0, top_k=20, max_new_tokens=20, seed=1234)
    with Engine(target, drafter, make_policy(policy, SPS), EngineConfig(max_batch=4)) as engine:
        alone = engine.generate(PROMPTS[0], probe, timeout=30)
        others = [engine.submit(p, SamplingParams(0.9, top_p=0.9, max_new_tokens=m, seed=i))
                  for i, (p, m) in enumerate(zip(PROMPTS[1:], MAX_NEW[1:]))]
        batched = engine.generate(PROMPTS[0], probe, timeout=30)
        other_seed = engine.generate(PROMPTS[0], SamplingParams(1.0, top_k=20, max_new_tokens=20, seed=99), timeout=30)
        for h in others:
            h.result(30)
    assert batched == alone
    assert other_seed != alone  # negative control: the output is really sampled


def test_prompt_lookup_drafter_and_async_stream(target):
    """A drafter without a confidence head (fallback confidence) through the asyncio stream API."""
    drafter = PromptLookupDrafter(target.vocab_size, GAMMA)
    sampling = SamplingParams(0.0, max_new_tokens=25)
    expected = _plain(target, PROMPTS[0], sampling)

    async def consume(engine):
        handle = engine.submit(PROMPTS[0], sampling, loop=asyncio.get_running_loop())
        tokens, reason = [], None
        async for event in handle.stream():
            tokens += event.token_ids
            reason = event.finish_reason
        return tokens, reason

    for policy in ("alg1", "threshold:0.9"):
        with Engine(target, drafter, make_policy(policy, SPS, fallback_confidence=0.7)) as engine:
            tokens, reason = asyncio.run(consume(engine))
        assert tokens == expected and reason == "length"


def test_queue_full_cancel_waiting_and_stop(target, drafter):
    engine = Engine(target, drafter, None, EngineConfig(max_batch=1, max_queue=1)).start()
    engine.pause()
    a = engine.submit(PROMPTS[0], SamplingParams(0.0, max_new_tokens=8))
    b = engine.submit(PROMPTS[1], SamplingParams(0.0, max_new_tokens=8))
    with pytest.raises(QueueFullError):
        engine.submit(PROMPTS[2], SamplingParams(0.0, max_new_tokens=8))
    assert engine.stats().queue_depth == 2 and engine.stats().requests["rejected"] == 1
    b.cancel()
    assert b.result(5) == ([], "cancelled")
    c = engine.submit(PROMPTS[2], SamplingParams(0.0, max_new_tokens=8))  # b's place is free again
    engine.resume()
    assert a.result(30)[1] == "length" and c.result(30)[1] == "length"
    engine.pause()
    d = engine.submit(PROMPTS[3], SamplingParams(0.0, max_new_tokens=8))
    engine.stop()
    assert d.result(5) == ([], "abort")
    with pytest.raises(EngineClosedError):
        engine.submit(PROMPTS[3], SamplingParams(0.0, max_new_tokens=8))


def test_cancel_active_request_frees_its_slot(target, drafter):
    with Engine(target, drafter, None, EngineConfig(max_batch=1, max_queue=4)) as engine:
        long = engine.submit(PROMPTS[0], SamplingParams(1.0, max_new_tokens=400, seed=0))
        waiting = engine.submit(PROMPTS[1], SamplingParams(0.0, max_new_tokens=6))
        _wait_first_tokens(long)
        long.cancel()
        tokens, reason = waiting.result(30)  # runs only once the long request left its slot
        assert reason == "length" and len(tokens) == 6
        rest = list(long.events(timeout=30))
        assert rest[-1].finish_reason == "cancelled"
        assert sum(len(e.token_ids) for e in rest) < 399
        assert engine.stats().requests["cancelled"] == 1


def test_stop_token_ids_and_length_limits(target, drafter):
    sampling = SamplingParams(0.0, max_new_tokens=30)
    plain = _plain(target, PROMPTS[2], sampling)
    stop = plain[5]
    cut = plain.index(stop) + 1
    with Engine(target, drafter, None) as engine:
        tokens, reason = engine.submit(PROMPTS[2], SamplingParams(0.0, max_new_tokens=30, stop_token_ids=[stop])).result(30)
        assert (tokens, reason) == (plain[:cut], "stop")
        assert engine.submit(PROMPTS[2], SamplingParams(0.0, max_new_tokens=1)).result(30) == (plain[:1], "length")
        with pytest.raises(PromptError, match="context"):
            engine.submit([5] * 500, SamplingParams(0.0, max_new_tokens=100))  # tiny context is 512
        with pytest.raises(PromptError, match="empty"):
            engine.submit([], SamplingParams(0.0))


def test_policy_names():
    assert [str(parse_policy(n)) for n in ("all", "fixed:1", "threshold:0.5", "ALG1", "async")] == [
        "all", "fixed:1", "threshold:0.5", "alg1", "async"]
    assert parse_policy("alg1").needs_sps_table and not parse_policy("fixed:2").needs_sps_table
    for bad in ("bogus", "fixed", "fixed:-1", "fixed:x", "threshold:1.5", "alg1:3"):
        with pytest.raises(PolicyError):
            parse_policy(bad)


def test_adapter_confidences_sts_and_fallback():
    tokens = torch.zeros(2, 3, dtype=torch.long)
    block = DraftBlock(tokens, torch.tensor([3, 1]), torch.zeros(2, 3, 5),
                       confidence_logits=torch.tensor([[0.0, 2.0, -2.0], [1.0, 1.0, 1.0]]))
    raw = ConfidenceAdapter(None).confidences(block)
    assert torch.allclose(raw, torch.sigmoid(block.confidence_logits.double()))
    scaled = ConfidenceAdapter(None, sts_temperatures=[1.0, 2.0, 4.0, 8.0]).confidences(block)
    assert torch.allclose(scaled, torch.sigmoid(block.confidence_logits.double() / torch.tensor([1.0, 2.0, 4.0])))
    block.confidence_logits = None
    fallback = ConfidenceAdapter(None, fallback_confidence=0.3).confidences(block)
    assert torch.equal(fallback, torch.full((2, 3), 0.3, dtype=torch.float64))
    # threshold above the fallback verifies nothing, below it everything
    assert make_policy("threshold:0.5", fallback_confidence=0.3).verify_len(block).tolist() == [0, 0]
    assert make_policy("threshold:0.2", fallback_confidence=0.3).verify_len(block).tolist() == [3, 1]
    assert make_policy("fixed:2").verify_len(block).tolist() == [2, 1]
    with pytest.raises(PolicyError):
        ConfidenceAdapter(None, fallback_confidence=1.5)


def test_stats_track_batches(target, drafter):
    with Engine(target, drafter, make_policy("fixed:2"), EngineConfig(max_batch=2)) as engine:
        handles = [engine.submit(p, SamplingParams(0.0, max_new_tokens=10)) for p in PROMPTS[:4]]
        results = [h.result(30) for h in handles]
        time.sleep(0.05)
        s = engine.stats()
    assert s.generation_tokens == sum(len(t) for t, _ in results)
    assert s.prompt_tokens == sum(len(p) for p in PROMPTS[:4])
    assert 1.0 <= s.avg_batch_size <= 2.0
    assert s.verified_tokens <= 2 * s.request_steps and s.accepted_tokens <= s.verified_tokens
    # tau = accepted + 1 per request-step, except a step ending on an accepted stop token (once per request)
    assert s.accepted_tokens + s.request_steps - 4 <= s.committed_tokens <= s.accepted_tokens + s.request_steps
    assert all(h.stats.num_steps >= 1 for h in handles)
    assert 0 < s.drafted_steps <= s.steps  # the last token of a request leaves no room for drafts


def test_async_skips_the_drafter_in_the_engine_and_counts_it(target, drafter):
    """A cost model whose drafting costs a second a step: after its lagged survivals async runs plain steps (the
    measured rates decide later; every 4th decision takes the other kind), the text stays plain's."""
    from dspark.scheduler.policies import AsyncTopKScheduler
    from dspark.scheduler.step_cost import CostCurve, StepCostModel

    verify = CostCurve(tuple(range(1, 65)), tuple(10.0 + b for b in range(1, 65)))
    policy = AsyncTopKScheduler(StepCostModel(verify, 64, draft=CostCurve((1,), (1000.0,))), lag=1, probe_every=4,
                                probe_steps=2)
    sampling = SamplingParams(0.0, max_new_tokens=24)
    with Engine(target, drafter, ConfidenceAdapter(policy, fallback_confidence=0.9)) as engine:
        texts = [engine.generate(p, sampling, timeout=30) for p in PROMPTS[:2]]
        s = engine.stats()
    assert texts == [_plain(target, p, sampling) for p in PROMPTS[:2]]
    assert 0 < s.drafted_steps < s.steps and policy.skipped_steps > 0


def test_step_times_record_every_pass_by_batch_tokens(target, drafter):
    """Every engine step is timed under its batch tokens B = sum (1 + l_r), every prefill chunk under its
    prompt tokens; the table is 1 / median seconds (an SGLang-format SPS table)."""
    with Engine(target, drafter, make_policy("fixed:2"), EngineConfig(max_batch=2, mix_prefill=False)) as engine:
        handles = [engine.submit(p, SamplingParams(0.0, max_new_tokens=10)) for p in PROMPTS[:4]]
        [h.result(30) for h in handles]
        time.sleep(0.05)
        s, seen = engine.stats(), engine.step_times.snapshot()
    verify, prefill = seen["verify"], seen["prefill"]
    assert sum(map(len, verify.values())) == s.steps
    assert sum(b * len(ts) for b, ts in verify.items()) == s.request_steps + s.verified_tokens
    assert sum(b * len(ts) for b, ts in prefill.items()) == s.prompt_tokens
    assert set(verify) <= set(range(1, 2 * 3 + 1))  # at most 2 requests x (1 + 2) tokens
    table = engine.step_times.table("verify")
    assert table.sample_batch_tokens == tuple(verify) and table.max_batch_tokens == 2 * max(verify)
    assert all(sps == pytest.approx(1 / statistics.median(verify[b]))
               for b, sps in zip(table.sample_batch_tokens, table.sample_steps_per_sec))


def test_a_prompt_fed_while_others_decode_shares_their_pass(target, drafter):
    """mix_prefill: a request admitted while others decode has its prompt fed in their step's pass (timed as
    ``mixed`` under B + its prompt tokens), and every request's greedy text is what it is with separate passes."""
    def run(mix: bool):
        with Engine(target, drafter, make_policy("fixed:2"), EngineConfig(max_batch=4, mix_prefill=mix)) as engine:
            first = [engine.submit(p, SamplingParams(0.0, max_new_tokens=12)) for p in PROMPTS[:2]]
            heads = [next(h.events(30)).token_ids for h in first]  # decoding before the next two arrive
            later = [engine.submit(p, SamplingParams(0.0, max_new_tokens=12)) for p in PROMPTS[2:4]]
            texts = [head + h.result(30)[0] for head, h in zip(heads + [[], []], first + later)]
            time.sleep(0.05)
            return texts, engine.stats(), engine.step_times.snapshot()

    texts, s, seen = run(True)
    mixed = seen["mixed"]
    assert mixed, "no prompt was fed in a decode step's pass"
    assert sum(map(len, seen["verify"].values())) + sum(map(len, mixed.values())) == s.steps
    passes_tokens = sum(b * len(ts) for kind in ("verify", "mixed", "prefill") for b, ts in seen[kind].items())
    assert passes_tokens == s.request_steps + s.verified_tokens + s.prompt_tokens
    separate, _, seen_separate = run(False)
    assert not seen_separate["mixed"]
    assert texts == separate


def test_step_times_keep_the_newest_and_merge():
    from dspark.serving.engine_stats import StepTimes

    times = StepTimes(keep=3)
    for t in (9.0, 1.0, 2.0, 4.0):
        times.add("verify", 5, t)
    times.add("prefill", 64, 0.5)
    assert times.snapshot() == {"verify": {5: [1.0, 2.0, 4.0]}, "prefill": {64: [0.5]}, "mixed": {}}
    assert times.table("verify").sample_steps_per_sec == (0.5,) and times.table("verify", min_passes=4) is None
    pooled = StepTimes()
    pooled.merge(times)
    pooled.merge(times)
    assert pooled.summary()["verify"] == {"5": [6, 2.0]}
    times.clear()
    assert times.table("prefill") is None


def test_dspark_drafter_confidence_head_through_the_engine(target):
    """A (random) DSpark drafter: target features and confidence logits flow through continuous batching."""
    from dspark.drafters.dspark.drafter import DSparkDrafter
    from tests.drafters.tiny_drafters import tiny_dspark

    drafter = DSparkDrafter(tiny_dspark(target))
    sampling = [SamplingParams(0.0, max_new_tokens=m) for m in MAX_NEW]
    expected = [_plain(target, p, s) for p, s in zip(PROMPTS, sampling)]
    verify = {}
    for policy in ("all", "threshold:0.5", "alg1", "async"):
        sts = [1.0, 2.0, 0.5, 1.0] if policy == "alg1" else None
        with Engine(target, drafter, make_policy(policy, SPS, sts), EngineConfig(max_batch=3)) as engine:
            handles = [engine.submit(p, s) for p, s in zip(PROMPTS, sampling)]
            assert [h.result(30)[0] for h in handles] == expected, policy
            verify[policy] = engine.stats().avg_verify_len
    assert verify["threshold:0.5"] < verify["all"] and verify["alg1"] < verify["all"]


@pytest.mark.parametrize("policy", ["threshold:0.7", "alg1"])  # STS cannot move a 0.5 threshold's cut
def test_eval_and_serve_schedule_a_drafter_alike(target, drafter, policy):
    """``evaluate`` (policy + STS temperatures per drafter) and the engine (``make_policy``) share one adapter.

    Greedy decoding, one request at a time on both sides: the same confidences must give the same
    verify length at every step, so the per-step (verified, accepted) histograms are equal.
    Negative control: eval without the STS temperatures schedules differently.
    """
    from dspark.data.eval_sets import token_dataset
    from dspark.evaluation.runner import evaluate
    from dspark.generation.stats import AcceptanceStats
    from dspark.scheduler.adapter import build_scheduler

    sts = [1.0, 3.0, 0.3, 1.0]
    datasets = [token_dataset("gsm8k", PROMPTS)]

    def eval_counts(temperatures):
        res = evaluate(target, {"d": drafter}, datasets, temperature=0.0, max_new_tokens=16,
                       policy=build_scheduler(parse_policy(policy), SPS), temperatures=temperatures,
                       progress=False, write_outputs=False)
        return res["drafters"]["d"]["benchmarks"]["gsm8k"]["stats"]["counts"]

    served = AcceptanceStats(GAMMA)
    with Engine(target, drafter, make_policy(policy, SPS, sts), EngineConfig(max_batch=1)) as engine:
        for p in PROMPTS:
            handle = engine.submit(p, SamplingParams(0.0, max_new_tokens=16))
            handle.result(30)
            served.merge(handle.stats)
    assert served.num_proposed < GAMMA * served.num_steps  # the policy really cut some blocks
    assert eval_counts({"d": sts}) == served.counts
    assert eval_counts(None) != served.counts
