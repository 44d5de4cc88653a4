"""The real loop is lossless: DSpark drafts, every sampling setting, every verify policy.

Each test runs ``SpeculativeGenerator`` (prefill + the real ``speculative_step``) on a tiny
target (V = 6) with a tiny DSpark drafter whose confidence head is live, and compares the
joint law of the 2nd and 3rd generated tokens (the ones that go through drafting and
verification) with the exact law from enumerating every context (tests/generation/laws.py).
Check: ``goodness_of_fit`` (tests/sampling/stats.py): no impossible outcome, chi-square
p >= 1e-6 and total variation below the distribution-free bound. Each test has a negative
control in the same setting: a bug injected into the drafter or the policy that the same
statistic must reject (p < 1e-9).

With ``max_new_tokens=4`` the first cycle may draft two tokens (budget 3 after prefill),
so a policy's decision about draft 1 can read the confidence of draft 2, which reads
draft 1 (eq. 7): exactly the leak of the retrospective search (paper Appendix A).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dspark.drafters.draft_sampler as draft_sampler  # where the DSpark drafter samples its sampled rows
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams, logits_to_probs, sample_with_uniforms
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import (
    AsyncTopKScheduler,
    FixedLength,
    GreedyPrefixScheduler,
    RetrospectiveGlobalSearch,
    StaticThreshold,
    VerifyPolicy,
)
from dspark.scheduler.sps import SPSTable
from tests.drafters.tiny_drafters import tiny_dspark
from tests.generation.laws import drafted_pair_law, pair_samples
from tests.sampling.stats import goodness_of_fit
from tests.scheduler.biased_policies import CurrentStepCapacity
from tests.tiny import tiny_target

V = 6
PROMPT = [3, 4, 3, 4, 3]
NUM_REQUESTS = 2000
CHUNK = 1000  # requests per generate call: policies keep their history across calls
REJECT_P = 1e-9  # a negative control must be rejected far beyond the 1e-6 false-alarm level


def _target():
    return tiny_target(seed=6, sharp=1.0, vocab_size=V, eos_token_id=999)  # no stop token


# c(x_{k-1}) by previous token: three levels, so that a_1 sits above, near or below the schedulers'
# thresholds (see CLIFF below); token 5 is the one after which the retrospective search stops. The
# levels' placement and the drafter seed were picked, by the retrospective search's exact bias on
# token 2, so that its negative control fails by a wide margin at this sample size.
CONF = torch.tensor([0.6, 0.6, 0.95, 0.6, 0.6, 0.05], dtype=torch.float64)
STS = (2.0, 2.0, 2.0, 2.0)  # per-position temperatures T_k: the adapter's calibration path runs


def _drafter(target) -> DSparkDrafter:
    """A tiny DSpark drafter whose calibrated confidence reads only the previous token: c_k = CONF[x_{k-1}].

    Eq. (7) with the hidden-state part of w zeroed and the W1[x_{k-1}] part solved for, so that
    sigmoid(logit / T_k) = CONF[x_{k-1}]: a_{r,2} then carries information about draft 1.
    """
    # the draft layers this law test and its negative controls were sized with (the law holds for any layers)
    model = tiny_dspark(target, seed=2, markov_rank=V, draft_layer="target")
    H = model.spec.hidden_size
    proj = model.confidence_head.proj
    w1 = model.markov_head.markov_w1.weight.detach().double()  # (V, r), r = V here
    logits = torch.logit(CONF) * STS[0]  # (V,)
    with torch.no_grad():
        proj.weight.zero_()
        proj.bias.zero_()
        proj.weight[0, H:] = torch.linalg.solve(w1, logits).float()
    return DSparkDrafter(model)


def _generate(target, drafter, sampling: SamplingParams, policy=None) -> list[list[int]]:
    gen = SpeculativeGenerator(target, drafter, policy=policy)
    n, out = NUM_REQUESTS, []
    for start in range(0, n, CHUNK):
        sp = [SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, 4, seed=i)
              for i in range(start, min(n, start + CHUNK))]
        out += [r.output_ids for r in gen.generate([PROMPT] * len(sp), sp)]
    return out


# ------------------------------------------------------------------ sampling settings
# name: (the request's settings, the setting a buggy drafter leaves out of its reported draft_probs)
SAMPLING = {
    "temperature-0.4": (SamplingParams(temperature=0.4), {"temperature": 1.0}),
    "top-k-3": (SamplingParams(temperature=1.5, top_k=3), {"top_k": 0}),
    "top-p-0.6": (SamplingParams(temperature=1.5, top_p=0.6), {"top_p": 1.0}),
}


def _report_draft_probs_without(monkeypatch, sampling: SamplingParams, dropped: dict) -> None:
    """BUG on purpose: the drafter samples each draft with the request's settings but reports
    ``draft_probs`` computed without one of them (e.g. before the top-k cut).

    A drafter that ignores a setting both when sampling and when reporting stays lossless
    (the verifier corrects any proposal it is told the truth about); the bug is the mismatch.
    """
    s, wrong = sampling, dataclasses.replace(sampling, **dropped)
    monkeypatch.setattr(draft_sampler, "logits_to_probs_rows",
                        lambda logits, *_: logits_to_probs(logits, wrong.temperature, wrong.top_k, wrong.top_p))
    # log(reported) * T' recovers the logits up to a constant: sample from the request's processed law
    monkeypatch.setattr(draft_sampler, "sample_with_uniforms", lambda probs, u: sample_with_uniforms(
        logits_to_probs(probs.log() * wrong.temperature, s.temperature, s.top_k, s.top_p), u))


@pytest.mark.parametrize("lossy", [False, True], ids=["lossless", "draft-probs-without-the-setting"])
@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampling_settings_keep_the_processed_target_law(name, lossy, monkeypatch):
    """Temperature, top-k and top-p apply to target and draft alike; the loop must give the processed
    target's law. Negative control: the drafter's reported draft_probs leave the setting out."""
    sampling, dropped = SAMPLING[name]
    target = _target()
    if lossy:
        _report_draft_probs_without(monkeypatch, sampling, dropped)
    out = _generate(target, _drafter(target), sampling)
    fit = goodness_of_fit(pair_samples(out, V), drafted_pair_law(target, PROMPT, sampling))
    if lossy:
        assert not fit.passes and fit.p_value < REJECT_P, fit
    else:
        assert fit.passes, fit


# ------------------------------------------------------------------ verify policies
# One request: SPS 1.0 for the anchor alone, 1 / 1.8 for any verified draft, flat after. A first
# admission pays iff a_1 > 0.8, and then the second one pays too. Algorithm 1 verifies both drafts iff
# c(x_1) = 0.95; the retrospective search iff a_1 (1 + c_2) > 0.8, so after an anchor with c = 0.6
# its decision about draft 1 reads c_2 = CONF[draft 1]: it verifies draft 1 unless it is one of 5-7.
CLIFF = SPSTable((1, 2), (1.0, 1 / 1.8), max_batch_tokens=1 << 20)


class PerGroup:
    """Runs one policy instance per group of ``size`` consecutive requests of a step.

    The loop hands a policy the whole static batch (thousands of requests here), where a
    global policy is nearly independent of any one request's drafts. Small groups are the
    setting in which a leaking policy shows; instances (and the async history) persist
    across steps and generate calls.
    """

    def __init__(self, make_policy, size: int) -> None:
        self.make_policy, self.size = make_policy, size
        self.instances: list[VerifyPolicy] = []
        self.requires_confidences = make_policy().requires_confidences
        self.lengths: list[torch.Tensor] = []  # every verify_len chosen, for the non-vacuity check

    def choose(self, confidences, num_candidates):  # (R, K), (R,) -> (R,)
        out = []
        for i, start in enumerate(range(0, num_candidates.shape[0], self.size)):
            if i == len(self.instances):
                self.instances.append(self.make_policy())
            rows = slice(start, start + self.size)
            out.append(self.instances[i].choose(None if confidences is None else confidences[rows],
                                                num_candidates[rows]))
        self.lengths.append(torch.cat(out))
        return self.lengths[-1]


# name: (policy factory, requests per group, adaptive: must really vary the verify length)
POLICIES = {
    "verify-all": (None, 1, False),
    "fixed-1": (lambda: FixedLength(1), 1, False),
    "static-threshold": (lambda: StaticThreshold(0.5), 1, True),
    "algorithm1-single": (lambda: GreedyPrefixScheduler(CLIFF), 1, True),
    "async-topk-single": (lambda: AsyncTopKScheduler(CLIFF), 1, True),
}
BIASED_POLICIES = {
    "retrospective-single": (lambda: RetrospectiveGlobalSearch(CLIFF), 1),
    "async-lag0-single": (lambda: CurrentStepCapacity(CLIFF), 1),
}
T1 = SamplingParams(temperature=1.0)


def _run_policy(make_policy, size):
    target = _target()
    policy = None if make_policy is None else PerGroup(make_policy, size)
    adapter = ConfidenceAdapter(policy, sts_temperatures=STS)
    out = _generate(target, _drafter(target), T1, adapter)
    return goodness_of_fit(pair_samples(out, V), drafted_pair_law(target, PROMPT, T1)), policy


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_verify_policy_keeps_the_target_law(name):
    make_policy, size, adaptive = POLICIES[name]
    fit, policy = _run_policy(make_policy, size)
    assert fit.passes, fit
    if adaptive:  # not vacuous: the policy verifies nothing in some cycles and both drafts in others
        lengths = torch.cat(policy.lengths)
        share = torch.bincount(lengths, minlength=3).double() / lengths.numel()
        assert share[0] > 0.05 and share[2] > 0.05, share


@pytest.mark.parametrize("name", list(BIASED_POLICIES))
def test_negative_control_leaking_policies_are_rejected(name):
    """Same setting as the single-request policies: a policy that sizes verification from the current
    drafts' survivals (retrospective search, async with lag 0) must fail the same check."""
    fit, _ = _run_policy(*BIASED_POLICIES[name])
    assert not fit.passes and fit.p_value < REJECT_P, fit


class EveryOtherStepDrafts(PerGroup):
    """A draft gate (``AsyncTopKScheduler.should_draft``'s hook) that skips the drafter in every other step:
    decided before the step from the step count alone, as the real gate decides from past steps."""

    def __init__(self, first_drafts: bool = False) -> None:
        super().__init__(lambda: FixedLength(2), 1)
        self.first_drafts = first_drafts
        self.gates: list[bool] = []
        self.never_drafted: list[int] = []  # what the step reported: requests of the batch that never drafted

    def should_draft(self, num_requests: int, never_drafted: int = 0) -> bool:
        self.never_drafted.append(never_drafted)
        self.gates.append(len(self.gates) % 2 == (0 if self.first_drafts else 1))
        return self.gates[-1]


def test_steps_that_skip_the_drafter_keep_the_target_law():
    """A skipped step verifies the anchors alone (a plain step); the next drafting step's drafter catches up on
    the context it missed. The joint law of the 2nd and 3rd tokens holds across both kinds of step."""
    target = _target()
    policy = EveryOtherStepDrafts()
    out = _generate(target, _drafter(target), T1, ConfidenceAdapter(policy, sts_temperatures=STS))
    fit = goodness_of_fit(pair_samples(out, V), drafted_pair_law(target, PROMPT, T1))
    assert fit.passes, fit
    assert True in policy.gates and False in policy.gates
    assert int(torch.cat(policy.lengths).sum()) > 0  # the drafting steps did verify drafts
    # every request is new to drafting until the first drafting step (the second), then none is
    first = policy.never_drafted[0]
    assert policy.never_drafted[0] > 0 and policy.never_drafted[1] == policy.never_drafted[0]  # a plain step: new


def test_a_step_tells_the_gate_how_many_requests_never_drafted():
    """``RequestState.drafted_steps`` counts the steps whose drafter ran for the request; the gate hears how many
    of the batch have none (``AsyncTopKScheduler`` probes such a batch sooner)."""
    target = _target()
    policy = EveryOtherStepDrafts(first_drafts=True)
    gen = SpeculativeGenerator(target, _drafter(target), policy=ConfidenceAdapter(policy, sts_temperatures=STS))
    gen.generate([PROMPT] * 3, [SamplingParams(1.0, max_new_tokens=12, seed=i) for i in range(3)])
    assert policy.gates[:2] == [True, False] and policy.never_drafted[:2] == [3, 0]


class SomeRequestsDraft(PerGroup):
    """A per-request draft gate (``AsyncTopKScheduler.drafting_requests``' hook): in each step every other request
    drafts, alternating which half by step, decided from the step count and the position in the batch alone."""

    def __init__(self) -> None:
        super().__init__(lambda: FixedLength(2), 1)
        self.steps = 0
        self.drafting: list[int] = []  # requests that drafted, per step

    def drafting_requests(self, requests) -> list[bool]:
        mask = [(r + self.steps) % 2 == 0 for r in range(len(requests))]
        self.steps += 1
        self.drafting.append(sum(mask))
        return mask


@pytest.mark.parametrize("lossy", [False, True], ids=["lossless", "probs-spread-to-the-next-row"])
def test_steps_where_some_requests_draft_keep_the_target_law(lossy, monkeypatch):
    """The drafter runs on the drafting requests alone (``DraftBlock.spread`` widens its block to the batch); the
    others verify their anchor and catch up later. The joint law of the 2nd and 3rd tokens holds. Negative control:
    each drafting request's distributions spread to the next drafting request's row, its tokens to its own."""
    from dspark.drafters.base import DraftBlock

    if lossy:
        honest = DraftBlock.spread
        monkeypatch.setattr(DraftBlock, "spread", lambda self, rows, R: honest(
            dataclasses.replace(self, draft_probs=self.draft_probs.roll(1, 0)), rows, R))
    target = _target()
    policy = SomeRequestsDraft()
    out = _generate(target, _drafter(target), T1, ConfidenceAdapter(policy, sts_temperatures=STS))
    fit = goodness_of_fit(pair_samples(out, V), drafted_pair_law(target, PROMPT, T1))
    if lossy:
        assert not fit.passes and fit.p_value < REJECT_P, fit
        return
    assert fit.passes, fit
    assert 0 < min(policy.drafting) and max(policy.drafting) < CHUNK  # some requests drafted, never all
    assert int(torch.cat(policy.lengths).sum()) > 0


class BoundedDrafts(PerGroup):
    """A gate with ``AsyncTopKScheduler.draft_bound``'s hook: every third step its requests propose one draft, the
    others two, decided from the step count alone (the real bound reads past steps only)."""

    def __init__(self) -> None:
        super().__init__(lambda: FixedLength(2), 1)
        self.bounds: list[int] = []

    def draft_bound(self, num_requests: int, num_drafting: int) -> int:
        self.bounds.append(1 if len(self.bounds) % 3 == 0 else 2)
        return self.bounds[-1]


def test_steps_whose_drafts_are_bounded_by_past_steps_keep_the_target_law():
    """Drafts deeper than the bound are never proposed (the drafter drafts fewer positions); the joint law of the
    2nd and 3rd tokens holds."""
    target = _target()
    policy = BoundedDrafts()
    out = _generate(target, _drafter(target), T1, ConfidenceAdapter(policy, sts_temperatures=STS))
    fit = goodness_of_fit(pair_samples(out, V), drafted_pair_law(target, PROMPT, T1))
    assert fit.passes, fit
    lengths = torch.cat(policy.lengths)
    assert 1 in policy.bounds and 2 in policy.bounds and int(lengths.max()) == 2  # both kinds of step ran
    # a step bounded to one draft verified at most one (its block was one draft wide)
    ones = [length for b, length in zip(policy.bounds, policy.lengths) if b == 1]
    assert ones and all(int(length.max()) <= 1 for length in ones)


# ------------------------------------------------------------------ draft vocabulary
DRAFT_VOCAB = [0, 2, 3, 5]  # the drafter samples among 4 of the 6 tokens; its draft_probs are over these


@pytest.mark.parametrize("lossy", [False, True], ids=["lossless", "probs-scattered-to-the-wrong-tokens"])
def test_a_draft_vocabulary_keeps_the_target_law(lossy, monkeypatch):
    """A drafter with a draft vocabulary reports its distributions over the W tokens (``DraftBlock.vocab``);
    verification reads them over V for the sampled requests (``DraftBlock.rows``). Negative control: read one token
    off."""
    from dspark.drafters.base import DraftBlock

    target = _target()
    drafter = DSparkDrafter(_drafter(target).model, draft_vocab=DRAFT_VOCAB)
    assert drafter.draft_vocab.tolist() == DRAFT_VOCAB
    if lossy:
        honest = DraftBlock.rows
        monkeypatch.setattr(DraftBlock, "rows", lambda self, rows, K, V: honest(
            dataclasses.replace(self, vocab=self.vocab.roll(1)), rows, K, V))
    out = _generate(target, drafter, T1)
    fit = goodness_of_fit(pair_samples(out, V), drafted_pair_law(target, PROMPT, T1))
    if lossy:
        assert not fit.passes and fit.p_value < REJECT_P, fit
    else:
        assert fit.passes, fit
