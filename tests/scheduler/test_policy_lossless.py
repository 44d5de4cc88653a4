"""Statistical losslessness of speculative decoding under each verify-length policy.

Synthetic setting (V = 6 tokens, gamma = 3):

- target: a fixed Markov chain, target_probs(next | prev) = TARGET[prev];
- drafter: a different Markov chain DRAFT[prev], sampled left to right like
  DSpark's sequential head;
- confidence: c_{r,j} = CONF[x_{r,j-1}] reads the *previous* draft token (the
  anchor for j = 1), as DSpark's head does through W1[x_{k-1}] (eq. 7), so the
  survival a_{r,j+1} carries information about x_{r,j}.

Each request runs a "generate two tokens" process: one speculative step from
its anchor; if that step emitted a single token, a second step from that token.
For a lossless scheme the first two generated tokens (o1, o2) must follow the
target exactly: P(o1, o2) = sum_x0 pi(x0) TARGET[x0, o1] TARGET[o1, o2]. We
compare the empirical joint (36 cells) with a chi-square test.

Bound: the chi-square statistic with 35 degrees of freedom must stay below its
1 - 1e-4 quantile (~75) for every causal policy; the Appendix-A retrospective
search and the async policy with lag 0 (negative controls, one request per
policy call) must exceed it many times over. With 4 requests per call even they
stay under the bound, so the batch rows check batch mechanics only
(docs/testing.md). Seeds are fixed, so
the tests are deterministic; the quantile says how unlikely a false failure is
for any seed.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark.sampling.rejection import rejection_sample
from dspark.scheduler.policies import (
    AsyncTopKScheduler,
    FixedLength,
    GreedyPrefixScheduler,
    RetrospectiveGlobalSearch,
    StaticThreshold,
    VerifyPolicy,
)
from dspark.scheduler.sps import SPSTable
from tests.scheduler.biased_policies import CurrentStepCapacity

V = 6
GAMMA = 3

# The drafter proposes tokens 0-3 no more often than the target wants them
# (they are always accepted) and over-proposes 4 and 5. Confidence is high after
# 0 and 1, middling after 2 and 3, low after 4 and 5.
TARGET = torch.tensor(
    [
        [0.20, 0.20, 0.15, 0.15, 0.15, 0.15],
        [0.25, 0.15, 0.20, 0.10, 0.10, 0.20],
        [0.15, 0.20, 0.20, 0.15, 0.20, 0.10],
        [0.20, 0.25, 0.10, 0.15, 0.15, 0.15],
        [0.15, 0.15, 0.20, 0.20, 0.10, 0.20],
        [0.20, 0.20, 0.15, 0.20, 0.15, 0.10],
    ],
    dtype=torch.float64,
)
DRAFT = torch.tensor(
    [
        [0.15, 0.15, 0.10, 0.10, 0.25, 0.25],
        [0.20, 0.10, 0.10, 0.10, 0.20, 0.30],
        [0.10, 0.15, 0.15, 0.10, 0.30, 0.20],
        [0.15, 0.15, 0.10, 0.10, 0.25, 0.25],
        [0.10, 0.10, 0.15, 0.15, 0.20, 0.30],
        [0.15, 0.15, 0.10, 0.15, 0.25, 0.20],
    ],
    dtype=torch.float64,
)
CONF = torch.tensor([0.95, 0.95, 0.50, 0.50, 0.10, 0.10], dtype=torch.float64)  # c(prev token)
ANCHOR_PROBS = torch.tensor([0.125, 0.125, 0.25, 0.25, 0.125, 0.125], dtype=torch.float64)  # pi(x0)

# Jagged SPS table: one token per request is cheap (SPS 1.0 at B = 1), any
# verified draft costs a cliff (0.6), further ones are free up to B = 4, and
# bigger batches (several requests) step down again.
SPS_TABLE = SPSTable(
    sample_batch_tokens=(1, 2, 5, 9, 13),
    sample_steps_per_sec=(1.0, 0.6, 0.5, 0.3, 0.25),
    max_batch_tokens=16,
)


def _chi2_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal z."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


CHI2_BOUND = _chi2_quantile(V * V - 1, z=3.719)  # 1 - 1e-4 quantile, ~75.1


def _expected_joint() -> torch.Tensor:  # (V, V) P(o1, o2) under the target
    first = ANCHOR_PROBS @ TARGET  # (V,) P(o1)
    return first[:, None] * TARGET


def _speculative_step(
    anchors: torch.Tensor,  # (N,) int64
    policy: VerifyPolicy,
    batch_size: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # (N, GAMMA + 1) emitted tokens (-1 padded), (N,) verify_len
    """Draft, schedule (batch_size requests per policy call), verify."""
    N = anchors.shape[0]
    draft_tokens = torch.empty(N, GAMMA, dtype=torch.long)
    draft_probs = torch.empty(N, GAMMA, V, dtype=torch.float64)
    target_probs = torch.empty(N, GAMMA + 1, V, dtype=torch.float64)
    confidences = torch.empty(N, GAMMA, dtype=torch.float64)
    prev = anchors
    for k in range(GAMMA):
        draft_probs[:, k] = DRAFT[prev]
        target_probs[:, k] = TARGET[prev]
        confidences[:, k] = CONF[prev]  # c_{r,k+1} reads x_{r,k} (the anchor for k = 0)
        prev = torch.multinomial(DRAFT[prev], 1, generator=gen).squeeze(1)
        draft_tokens[:, k] = prev
    target_probs[:, GAMMA] = TARGET[prev]
    # some requests propose fewer drafts; their padding confidences are real (and
    # informative) numbers that a policy must ignore
    num_candidates = torch.where(torch.rand(N, generator=gen) < 0.8, GAMMA, 2)

    verify_len = torch.empty(N, dtype=torch.long)
    for start in range(0, N, batch_size):
        rows = slice(start, start + batch_size)
        verify_len[rows] = policy.choose(confidences[rows], num_candidates[rows])
    assert bool((verify_len <= num_candidates).all())
    out = rejection_sample(draft_tokens, verify_len, draft_probs, target_probs, [gen] * N)
    return out.output_tokens, verify_len


def _two_token_chi2(
    policy: VerifyPolicy, batch_size: int, num_requests: int, seed: int
) -> tuple[float, float, torch.Tensor]:
    """Run the two-token process; (chi-square, total variation, share of steps per verify_len)."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.multinomial(ANCHOR_PROBS, num_requests, replacement=True, generator=gen)
    emitted, verify_len = _speculative_step(anchors, policy, batch_size, gen)  # (N, GAMMA + 1), (N,)
    first, second = emitted[:, 0], emitted[:, 1].clone()
    again = second < 0  # the first step emitted only one token
    emitted_again, verify_len_again = _speculative_step(first[again], policy, batch_size, gen)
    second[again] = emitted_again[:, 0]
    all_lens = torch.cat([verify_len, verify_len_again])
    len_share = torch.bincount(all_lens, minlength=GAMMA + 1).double() / all_lens.numel()  # (GAMMA + 1,)

    counts = torch.bincount(first * V + second, minlength=V * V).double()  # (V*V,)
    expected = num_requests * _expected_joint().reshape(-1)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    tv = 0.5 * float((counts - expected).abs().sum()) / num_requests
    return chi2, tv, len_share


# name: (policy factory, requests per policy call, requests in the test). One
# request per call costs a Python call per request, hence the smaller sample.
CAUSAL_POLICIES = {
    "fixed-1": (lambda: FixedLength(1), 4, 40_000),
    "fixed-gamma": (lambda: FixedLength(GAMMA), 4, 40_000),
    "static-threshold": (lambda: StaticThreshold(0.5), 4, 40_000),
    "algorithm1-single": (lambda: GreedyPrefixScheduler(SPS_TABLE), 1, 20_000),
    "algorithm1-batch": (lambda: GreedyPrefixScheduler(SPS_TABLE), 4, 40_000),
    "async-topk-single": (lambda: AsyncTopKScheduler(SPS_TABLE), 1, 20_000),
    "async-topk-batch": (lambda: AsyncTopKScheduler(SPS_TABLE), 4, 40_000),
}

ADAPTIVE = ("static-threshold", "algorithm1-single", "algorithm1-batch", "async-topk-single", "async-topk-batch")


@pytest.mark.parametrize("name", list(CAUSAL_POLICIES))
def test_causal_policy_is_lossless(name: str) -> None:
    make_policy, batch_size, num_requests = CAUSAL_POLICIES[name]
    chi2, tv, len_share = _two_token_chi2(make_policy(), batch_size, num_requests, seed=1234)
    assert chi2 < CHI2_BOUND, f"{name}: chi2 {chi2:.1f} >= {CHI2_BOUND:.1f} (TV {tv:.4f})"
    if name in ADAPTIVE:  # not vacuous: the policy really varies the verify length
        assert len_share[0] > 0.05 and len_share[2:].sum() > 0.05, f"{name}: verify_len shares {len_share}"


BIASED_POLICIES = {
    "retrospective": lambda: RetrospectiveGlobalSearch(SPS_TABLE),
    "async-lag0": lambda: CurrentStepCapacity(SPS_TABLE),
}


@pytest.mark.parametrize("name", list(BIASED_POLICIES))
def test_negative_control_leaking_policies_are_biased(name: str) -> None:
    """Negative controls (paper Appendix A), same setting as algorithm1-single and async-topk-single.

    The async policy with lag 0 sizes the batch from this step's survivals; with one request per
    step that is exactly the retrospective search below.

    Why it leaks. One request per step, so Theta(l) = (1 + a_1 + ... + a_l) * SPS(1 + l)
    with SPS = 1.0 at B = 1 and 0.6 at B = 2..4. Take an anchor 2 or 3, where
    a_1 = CONF[anchor] = 0.5: Theta(0) = 1 and Theta(1) = 0.9, so Algorithm 1
    stops at once (l = 0) whatever the drafts are. The retrospective search also
    looks at Theta(3) = 0.6 (1.5 + a_2 + a_3) with a_2 = 0.5 * CONF[x_1]: it
    beats 1 iff a_2 + a_3 > 1/6, i.e. iff x_1 is one of 0-3 (a_2 >= 0.25), never
    when x_1 is 4 or 5 (a_2 + a_3 <= 0.0975). So x_1 is sent to verification
    exactly when it is a token the drafter proposes no more often than the
    target wants (always accepted), and otherwise the step falls back to one
    target sample. With anchor 2: P(o1 in 0-3) = D(0-3) + D(4,5) * T(0-3)
    = 0.5 + 0.5 * 0.7 = 0.85 instead of T(0-3) = 0.7.
    """
    chi2, tv, _ = _two_token_chi2(BIASED_POLICIES[name](), batch_size=1, num_requests=20_000, seed=1234)
    assert chi2 > 5 * CHI2_BOUND, f"{name} not detected as biased: chi2 {chi2:.1f}, TV {tv:.4f}"
