"""The speculative loop: exact greedy equality, batching, seeds, stop handling."""

import pytest
import torch

from dspark.drafters.base import NoDrafter, RequestState
from dspark.drafters.draft_lm.drafter import DraftModelDrafter
from dspark.drafters.prompt_lookup import PromptLookupDrafter, lookup_continuation
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from tests.generation.laws import drafted_pair_law, pair_samples
from tests.sampling.stats import goodness_of_fit
from tests.tiny import tiny_target

PROMPTS = [[5, 9, 13, 5, 9], [7, 7, 8, 20, 31, 44, 7, 7], [60]]


def plain(target, prompts, sp):
    return [r.output_ids for r in SpeculativeGenerator(target, NoDrafter(target.vocab_size)).generate(prompts, sp)]


def test_lookup_continuation_prefers_longest_recent_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_continuation(toks, max_ngram=3, min_ngram=1, max_tokens=2) == [7, 8]
    assert lookup_continuation([4, 5, 6], 3, 1, 5) == []


@pytest.mark.parametrize("block_size", [1, 3, 7])
@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_lookup_greedy_equals_plain_greedy(block_size, batch):
    target = tiny_target(seed=1)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    prompts = PROMPTS[:batch]
    ref = plain(target, prompts, sp)
    gen = SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, block_size))
    out = gen.generate(prompts, sp)
    assert [r.output_ids for r in out] == ref
    # tiny random models repeat themselves, so lookup drafts do get accepted
    assert sum(r.stats.num_accepted for r in out) > 0


@pytest.mark.parametrize("block_size", [2, 5])
def test_draft_model_greedy_equals_plain_greedy(block_size):
    target = tiny_target(seed=2)
    other = tiny_target(seed=3).model  # a different random model with the same vocabulary
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    ref = plain(target, PROMPTS, sp)
    for draft_lm in (other, target.model):
        out = SpeculativeGenerator(target, DraftModelDrafter(draft_lm, target.vocab_size, block_size)).generate(PROMPTS, sp)
        assert [r.output_ids for r in out] == ref
    # drafting with the target itself is accepted every time: tau = block + 1 except at the end
    s = out[0].stats
    assert s.acceptance_length > block_size * 0.8


def test_seed_reproduces_and_batch_does_not_matter():
    target = tiny_target(seed=4, sharp=1.0)
    drafter = PromptLookupDrafter(target.vocab_size, 4)
    sp = [SamplingParams(temperature=1.0, max_new_tokens=25, seed=s) for s in (11, 12, 13)]
    gen = SpeculativeGenerator(target, drafter)
    together = [r.output_ids for r in gen.generate(PROMPTS, sp)]
    again = [r.output_ids for r in gen.generate(PROMPTS, sp)]
    alone = [gen.generate([p], [s])[0].output_ids for p, s in zip(PROMPTS, sp)]
    assert together == again == alone
    other_seed = gen.generate(PROMPTS[:1], [SamplingParams(temperature=1.0, max_new_tokens=25, seed=99)])
    assert other_seed[0].output_ids != together[0]


def test_stops_on_eos_and_max_tokens():
    target = tiny_target(seed=5)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    ref = plain(target, PROMPTS, sp)[0]
    # make the 4th greedy token a stop token: output must end right there
    stop = ref[3]
    sp_stop = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])
    for drafter in (NoDrafter(target.vocab_size), PromptLookupDrafter(target.vocab_size, 5)):
        out = SpeculativeGenerator(target, drafter).generate(PROMPTS[:1], sp_stop)[0]
        assert out.output_ids == ref[: ref.index(stop) + 1]
        assert out.finish_reason == "stop"
    out = SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, 7)).generate(PROMPTS[:1], sp)[0]
    assert len(out.output_ids) == 12 and out.finish_reason == "length"


LOOKUP_V = 8
LOOKUP_PROMPT = [5, 2, 7, 0, 3, 6, 1, 4]  # every token occurs: the lookup drafts after any first token


def _uniform_lookup_probs(drafter: PromptLookupDrafter) -> None:
    """BUG on purpose: the lookup reports a uniform draft distribution instead of the one-hot it drafted from."""
    inner = drafter.propose

    def propose(requests, max_tokens):
        block = inner(requests, max_tokens)
        proposed = block.draft_probs.sum(-1) > 0  # (R, K) real drafts, not padding
        block.draft_probs[proposed] = 1.0 / drafter.vocab_size
        return block

    drafter.propose = propose


@pytest.mark.parametrize("lossy", [False, True], ids=["one-hot", "uniform-draft-probs"])
def test_sampled_drafted_tokens_follow_target(lossy):
    """The loop (not just the sampler) is lossless: with max_new_tokens=3 the first cycle drafts token 2
    and the bonus or recovered token is token 3, so their joint law is checked against the target's
    (chi-square + TV bound, tests/sampling/stats.py). Negative control: uniform draft_probs."""
    V = LOOKUP_V
    target = tiny_target(seed=6, sharp=0.5, vocab_size=V, eos_token_id=999)  # no stop token
    drafter = PromptLookupDrafter(V, block_size=3)
    if lossy:
        _uniform_lookup_probs(drafter)
    n = 3000
    sp = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=i) for i in range(n)]
    out = SpeculativeGenerator(target, drafter).generate([LOOKUP_PROMPT] * n, sp)
    # not vacuous: every request's first cycle verified one lookup draft
    assert all(r.stats.counts[1][0] + r.stats.counts[1][1] >= 1 for r in out)
    fit = goodness_of_fit(pair_samples([r.output_ids for r in out], V), drafted_pair_law(target, LOOKUP_PROMPT, sp[0]))
    if lossy:
        assert not fit.passes and fit.p_value < 1e-9, fit
    else:
        assert fit.passes, fit


def _ignore_stops_inside_drafts(monkeypatch, target) -> None:
    """BUG on purpose: the loop checks only the last committed token of a cycle for a stop token."""
    import dspark.generation.step as step

    real_ids, real_check = step.stop_ids_for, step._check_finished
    monkeypatch.setattr(step, "stop_ids_for", lambda _target, req: set())
    monkeypatch.setattr(step, "_check_finished",
                        lambda req, new_tokens, _ids: real_check(req, new_tokens, real_ids(target, req)))


@pytest.mark.parametrize("lossy", [False, True], ids=["stops", "ignores-stops-inside-drafts"])
@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_a_stop_token_inside_accepted_drafts_ends_the_output(how, lossy, monkeypatch):
    """Greedy, drafting with the target itself: the first cycle drafts 5 tokens, all accepted, and the
    4th generated token (the 3rd draft) is a stop token. The output must end there, without a bonus."""
    ref = plain(tiny_target(seed=1, eos_token_id=999), PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    stop = ref[3]
    assert stop not in ref[:3]
    target = tiny_target(seed=1, eos_token_id=stop if how == "eos" else 999)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop] if how == "stop_token_ids" else [])
    drafter = DraftModelDrafter(target.model, target.vocab_size, 5)  # proposes the greedy continuation
    if lossy:
        _ignore_stops_inside_drafts(monkeypatch, target)
    out = SpeculativeGenerator(target, drafter).generate(PROMPTS[:1], sp)[0]
    first_cycle = out.stats.counts[5]
    ended_at_stop = out.output_ids == ref[:4] and out.finish_reason == "stop"
    if lossy:
        assert not ended_at_stop and out.output_ids[:4] == ref[:4], out.output_ids
    else:
        assert ended_at_stop, out.output_ids
        # one cycle: 5 drafts verified, 3 of them counted as accepted (up to the stop), tau = 3
        assert sum(first_cycle) == 1 and first_cycle[3] == 1 and out.stats.sum_acceptance_length == 3, out.stats


def test_the_loop_takes_a_verify_policy_bare_or_adapted():
    """``speculative_step`` runs any ``VerifyPolicy``; a bare one reads plain-sigmoid confidences."""
    from dspark.scheduler.confidence import ConfidenceAdapter
    from dspark.scheduler.policies import FixedLength

    target = tiny_target(seed=2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    ref = plain(target, PROMPTS, sp)
    drafter = DraftModelDrafter(target.model, target.vocab_size, 4)  # always accepted: verify length shows
    for policy in (FixedLength(1), ConfidenceAdapter(FixedLength(1))):
        out = SpeculativeGenerator(target, drafter, policy=policy).generate(PROMPTS, sp)
        assert [r.output_ids for r in out] == ref
        assert all(r.stats.counts[p][a] == 0 for r in out for p in range(2, 5) for a in range(p + 1))
        assert sum(r.stats.num_accepted for r in out) > 0


def test_mixed_settings_in_one_batch_give_each_request_its_text_alone():
    """Batched host work (one processing call and one rejection-sampling pass for the whole step): seeded
    requests with different temperature / top-k / top-p settings give, together, what each gives alone."""
    target = tiny_target(seed=4, sharp=1.0)
    gen = SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, 4))
    sp = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=25, seed=5),
          SamplingParams(temperature=0.0, max_new_tokens=25),
          SamplingParams(temperature=0.8, top_k=10, max_new_tokens=25, seed=6)]
    together = [r.output_ids for r in gen.generate(PROMPTS, sp)]
    alone = [gen.generate([p], [s])[0].output_ids for p, s in zip(PROMPTS, sp)]
    assert together == alone
    swapped = [gen.generate([p], [s])[0].output_ids for p, s in zip(PROMPTS, [sp[2], sp[1], sp[0]])]
    assert swapped[0] != together[0]  # negative control: the settings and seeds do reach each request


def test_a_fixed_length_policy_proposes_no_more_drafts_than_it_verifies():
    """fixed:N never verifies more than N drafts a request, so the step asks the drafter for at most N (fixed:1
    drafts one token, as MTP-1); without a bound the drafter is asked for its whole block. Greedy text: plain's."""
    from dspark.scheduler.policies import FixedLength

    target = tiny_target(seed=2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    inner = DraftModelDrafter(target.model, target.vocab_size, 4)
    asked: list[int] = []

    class Recording:  # the drafter, noting what each step asks of it
        def __getattr__(self, name):
            return getattr(inner, name)

        def propose(self, requests, max_tokens):
            asked.extend(max_tokens)
            return inner.propose(requests, max_tokens)

    for policy, most in ((FixedLength(2), 2), (FixedLength(1), 1), (None, 4)):
        asked.clear()
        out = SpeculativeGenerator(target, Recording(), policy=policy).generate(PROMPTS, sp)
        assert [r.output_ids for r in out] == plain(target, PROMPTS, sp)
        assert max(asked) == most, (policy, sorted(set(asked)))


def test_async_skips_the_drafter_where_its_cost_model_says_plain_steps_are_faster():
    """The asynchronous scheduler's draft gate on a cost model whose drafting costs 1 s a step: after its lagged
    survivals it decodes plain steps, then whichever kind of step it measured faster, trying the other every
    ``probe_every`` steps (so both kinds run, whatever the timings); the greedy text stays plain."""
    from dspark.drafters.dspark.drafter import DSparkDrafter
    from dspark.scheduler.policies import AsyncTopKScheduler
    from dspark.scheduler.step_cost import CostCurve, StepCostModel
    from tests.drafters.tiny_drafters import tiny_dspark

    target = tiny_target(seed=1)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    ref = plain(target, PROMPTS, sp)
    verify = CostCurve(tuple(range(1, 65)), tuple(10.0 + b for b in range(1, 65)))
    costly = StepCostModel(verify, 64, draft=CostCurve((1,), (1000.0,)))
    policy = AsyncTopKScheduler(costly, lag=1, probe_every=5)
    out = SpeculativeGenerator(target, DSparkDrafter(tiny_dspark(target, seed=3)), policy=policy).generate(PROMPTS, sp)
    assert [r.output_ids for r in out] == ref
    proposed = sum(r.stats.num_proposed for r in out)
    assert policy.skipped_steps > 0 and proposed > 0, (policy.skipped_steps, proposed)
