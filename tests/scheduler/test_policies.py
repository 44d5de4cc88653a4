"""Verify-length policies: hand-computed cases and loop references of Algorithm 1."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dspark.scheduler.policies import (
    AsyncTopKScheduler,
    FixedLength,
    GreedyPrefixScheduler,
    RetrospectiveGlobalSearch,
    StaticThreshold,
    VerifyPolicy,
    survival_from_confidences,
)
from dspark.scheduler.sps import SPSTable


def conf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def counts(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# Theta = tau * SPS(B) with a cliff after one token per request: see the cases below
CLIFF = SPSTable((1, 2), (1.0, 0.6), 4)


# --------------------------------------------------------------- survival
def test_survival_is_cumulative_product_and_ignores_padding() -> None:
    c = conf([[0.5, 0.5, 0.9], [0.8, float("nan"), 2.0]])  # row 1: padding may hold garbage
    survival = survival_from_confidences(c, counts([3, 1]))
    expected = torch.tensor([[0.5, 0.25, 0.225], [0.8, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(survival, expected)
    assert survival.dtype == torch.float64


# ----------------------------------------------------------------- fixed
def test_fixed_length() -> None:
    n = counts([3, 1, 0, 2])
    assert FixedLength(1).choose(None, n).tolist() == [1, 1, 0, 1]  # MTP-1-like, no head needed
    assert FixedLength(3).choose(None, n).tolist() == [3, 1, 0, 2]  # verify-all
    assert FixedLength(0).choose(None, n).tolist() == [0, 0, 0, 0]
    assert FixedLength(2).choose(torch.rand(4, 3), n).tolist() == [2, 1, 0, 2]
    with pytest.raises(ValueError, match="n >= 0"):
        FixedLength(-1)


# ------------------------------------------------------------- threshold
def test_static_threshold_is_per_step_not_cumulative() -> None:
    c = conf([[0.6, 0.6, 0.6], [0.9, 0.4, 0.9], [0.3, 0.9, 0.9], [0.9, 0.9, float("nan")]])
    n = counts([3, 3, 3, 2])
    # row 0: cumulative survival 0.216 < 0.5 after three steps, but every step passes
    # row 1: truncated at the first step below, later ones do not matter
    # row 3: padding (even NaN) is ignored
    assert StaticThreshold(0.5).choose(c, n).tolist() == [3, 1, 0, 2]
    assert StaticThreshold(0.0).choose(c[:3], n[:3]).tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="threshold in"):
        StaticThreshold(1.5)


# ------------------------------------------------------------ Algorithm 1
def test_algorithm1_two_requests_by_hand() -> None:
    table = SPSTable((2, 3, 4, 5, 6), (1.0, 0.9, 0.8, 0.6, 0.55), 8)
    c = conf([[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]])
    # survival r0: .9 .72 .36, r1: .6 .3 .27; path: (0,1) (0,2) (1,1) (0,3) (1,2) (1,3)
    # Theta_best = R * SPS(R) = 2 * 1.0 = 2.0
    # admit (0,1): tau 2.90, B 3 -> 2.90 * 0.9 = 2.610 > 2.0   keep
    # admit (0,2): tau 3.62, B 4 -> 3.62 * 0.8 = 2.896 > 2.610 keep
    # admit (1,1): tau 4.22, B 5 -> 4.22 * 0.6 = 2.532 <= 2.896 stop
    assert GreedyPrefixScheduler(table).choose(c, counts([3, 3])).tolist() == [2, 0]
    # later Thetas (2.519, 2.684, 2.833) never beat 2.896: the global search agrees here
    assert RetrospectiveGlobalSearch(table).choose(c, counts([3, 3])).tolist() == [2, 0]


def test_early_stop_differs_from_retrospective_search() -> None:
    # One request, survival .5 .45 .405. Theta(0) = 1.0 and Theta(1) = 1.5 * 0.6 = 0.9:
    # Algorithm 1 stops before x_1. The retrospective search goes on to
    # Theta(3) = 2.355 * 0.6 = 1.413 and verifies all three.
    c = conf([[0.5, 0.9, 0.9]])
    assert GreedyPrefixScheduler(CLIFF).choose(c, counts([3])).tolist() == [0]
    assert RetrospectiveGlobalSearch(CLIFF).choose(c, counts([3])).tolist() == [3]
    # Lower c_2 (which reads x_1) and the retrospective decision about x_1 flips:
    # Theta(3) = 1.595 * 0.6 = 0.957 < 1. That is the Appendix-A leak.
    c_low = conf([[0.5, 0.1, 0.9]])
    assert GreedyPrefixScheduler(CLIFF).choose(c_low, counts([3])).tolist() == [0]
    assert RetrospectiveGlobalSearch(CLIFF).choose(c_low, counts([3])).tolist() == [0]


def test_flat_table_verifies_every_surviving_draft() -> None:
    c = conf([[0.9, 0.0, 0.5], [0.7, 0.7, 0.7], [0.2, 0.2, 0.2]])
    n = counts([3, 2, 0])
    # zero survival is never admitted (Algorithm 1, line 4); padding is ignored
    assert GreedyPrefixScheduler(SPSTable.flat()).choose(c, n).tolist() == [1, 2, 0]


def test_capacity_caps_batch_tokens_with_deterministic_ties() -> None:
    # flat up to 5 tokens: 2 anchors + 3 drafts. Equal survivals go by position, then request.
    table = SPSTable.flat(max_batch_tokens=5)
    c = conf([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])
    assert GreedyPrefixScheduler(table).choose(c, counts([3, 3])).tolist() == [2, 1]
    assert RetrospectiveGlobalSearch(table).choose(c, counts([3, 3])).tolist() == [2, 1]


def _algorithm1_reference(c: list[list[float]], n: list[int], table: SPSTable, early_stop: bool) -> list[int]:
    """Algorithm 1 line by line (early_stop=False: Appendix A's retrospective search)."""
    R = len(c)
    a = [[math.prod(c[r][: j + 1]) for j in range(n[r])] for r in range(R)]  # line 2
    E = [(a[r][j], j, r) for r in range(R) for j in range(n[r]) if a[r][j] > 0]  # line 4
    E.sort(key=lambda e: (-e[0], e[1], e[2]))
    lengths, B, tau = [0] * R, R, float(R)  # line 5
    theta_best, best = R * table.sps(R), [0] * R  # line 6
    for a_rj, j, r in E:  # line 7
        assert lengths[r] == j  # the sorted order admits prefixes
        lengths[r], B, tau = j + 1, B + 1, tau + a_rj  # line 8
        theta = tau * table.sps(B)  # line 9
        if theta > theta_best:  # line 10
            theta_best, best = theta, list(lengths)  # line 11
        elif early_stop:  # lines 12-13
            break
    return best


def _random_case(rng: random.Random) -> tuple[list[list[float]], list[int], SPSTable]:
    R, K = rng.randint(1, 6), rng.randint(1, 5)
    # a few exact binary values make ties in survival and in Theta
    pick = lambda: rng.choice([0.0, 0.25, 0.5, 1.0, rng.random(), rng.random(), rng.random()])  # noqa: E731
    c = [[pick() for _ in range(K)] for _ in range(R)]
    n = [rng.randint(0, K) for _ in range(R)]
    grid = range(1, 3 * R * (K + 1))
    tokens = sorted(rng.sample(grid, min(len(grid), rng.randint(1, 6))))
    sps = [rng.choice([1.0, 0.5, 0.25, rng.uniform(0.1, 1.0)]) for _ in tokens]
    return c, n, SPSTable(tuple(tokens), tuple(sps), tokens[-1] + rng.randint(0, 2 * R))


def test_vectorised_policies_match_the_loop_reference() -> None:
    rng = random.Random(0)
    for _ in range(300):
        c, n, table = _random_case(rng)
        c_t, n_t = torch.tensor(c, dtype=torch.float64), counts(n)
        greedy = _algorithm1_reference(c, n, table, early_stop=True)
        retrospective = _algorithm1_reference(c, n, table, early_stop=False)
        assert GreedyPrefixScheduler(table).choose(c_t, n_t).tolist() == greedy
        assert RetrospectiveGlobalSearch(table).choose(c_t, n_t).tolist() == retrospective


# ------------------------------------------------------------ async top-K
JAGGED = SPSTable((2, 3, 4, 5), (1.0, 0.8, 0.75, 0.5), 8)


def test_async_uses_default_capacity_until_lagged_history_exists() -> None:
    policy = AsyncTopKScheduler(JAGGED)
    c = conf([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5]])
    assert policy.choose(c, counts([3, 3])).tolist() == [3, 3]  # step 1: verify-all
    assert policy.choose(c, counts([3, 2])).tolist() == [3, 2]  # step 2: still no step t-2
    assert policy.last_capacity is None
    limited = AsyncTopKScheduler(JAGGED, default_capacity=2)
    assert limited.choose(c, counts([3, 3])).tolist() == [2, 0]


def test_async_capacity_is_a_global_search_over_lagged_survivals() -> None:
    policy = AsyncTopKScheduler(JAGGED)
    lagged = conf([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])
    policy.choose(lagged, counts([3, 3]))  # step 1
    policy.choose(conf([[0.1, 0.1, 0.1], [0.1, 0.1, 0.1]]), counts([3, 3]))  # step 2
    # Step 3 reads step 1: survivals .9 .9 .81 .81 .729 .729, R = 2. Theta(b):
    # b=0: 2*1.0=2.0, 1: 2.9*.8=2.32, 2: 3.8*.75=2.85, 3: 4.61*.5=2.305,
    # 4: 5.42*.5=2.71, 5: 6.149*.5=3.0745, 6: 6.878*.5=3.439 (B = 8 = capacity).
    # The global argmax is b = 6, past the dip at b = 3 where Algorithm 1 would stop.
    assert policy.capacity(2) == 6
    assert GreedyPrefixScheduler(JAGGED).choose(lagged, counts([3, 3])).sum() == 2


def test_async_admits_top_k_current_candidates_and_k_ignores_them() -> None:
    def after_two_steps() -> AsyncTopKScheduler:
        policy = AsyncTopKScheduler(JAGGED)
        # step 1 survivals .9 .81 .729 / .5 .25 .125 -> Theta(b) 2.0 2.32 2.7825
        # 2.2195 2.4695 2.5945 2.657, so K* = 2
        policy.choose(conf([[0.9, 0.9, 0.9], [0.5, 0.5, 0.5]]), counts([3, 3]))
        policy.choose(conf([[0.3, 0.3, 0.3], [0.3, 0.3, 0.3]]), counts([3, 3]))
        return policy

    policy = after_two_steps()
    # K* = 2: the two best current candidates are (1,1) = .7 and (1,2) = .49
    assert policy.choose(conf([[0.2, 0.9, 0.9], [0.7, 0.7, 0.7]]), counts([3, 3])).tolist() == [0, 2]
    assert policy.last_capacity == 2
    # the same history with other current drafts: the same K*; ties by position, then request
    policy = after_two_steps()
    assert policy.choose(conf([[0.99, 0.99, 0.99], [0.99, 0.99, 0.99]]), counts([3, 3])).tolist() == [1, 1]
    # fewer candidates than K*: all of them
    policy = after_two_steps()
    assert policy.choose(conf([[0.9, 0.9], [0.9, 0.9]]), counts([1, 0])).tolist() == [1, 0]


def test_async_lag_and_reset() -> None:
    policy = AsyncTopKScheduler(JAGGED, lag=1)
    policy.choose(conf([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]]), counts([3, 3]))
    assert policy.capacity(2) == 6  # lag 1: the previous step
    policy.reset()
    assert policy.capacity(2) is None and policy.last_capacity is None
    with pytest.raises(ValueError, match="lag >= 1"):
        AsyncTopKScheduler(JAGGED, lag=0)
    with pytest.raises(ValueError, match="default_capacity"):
        AsyncTopKScheduler(JAGGED, default_capacity=-1)


def test_async_matches_a_loop_reference() -> None:
    rng = random.Random(1)
    for _ in range(30):
        table = SPSTable((1, 4, 9), (1.0, 0.7, 0.4), 16)
        policy, history = AsyncTopKScheduler(table), []
        for _ in range(6):
            c, n, _ = _random_case(rng)
            got = policy.choose(torch.tensor(c, dtype=torch.float64), counts(n)).tolist()
            R = len(c)
            a = sorted(
                ((math.prod(c[r][: j + 1]), j, r) for r in range(R) for j in range(n[r])),
                key=lambda e: (-e[0], e[1], e[2]),
            )
            a = [e for e in a if e[0] > 0]
            if len(history) < 2:
                k = len(a)
            else:
                pool = history[-2]
                thetas = [(R + sum(pool[:b])) * table.sps(R + b) for b in range(len(pool) + 1)]
                k = thetas.index(max(thetas))
            expected = [0] * R
            for _, j, r in a[:k]:
                expected[r] = max(expected[r], j + 1)
            assert got == expected
            history.append([e[0] for e in a])


# ---------------------------------------------------------------- errors
POLICY_FACTORIES = {
    "fixed": lambda: FixedLength(2),
    "threshold": lambda: StaticThreshold(0.5),
    "algorithm1": lambda: GreedyPrefixScheduler(CLIFF),
    "retrospective": lambda: RetrospectiveGlobalSearch(CLIFF),
    "async": lambda: AsyncTopKScheduler(CLIFF),
}


@pytest.mark.parametrize("name", list(POLICY_FACTORIES))
def test_protocol_and_output_contract(name: str) -> None:
    policy = POLICY_FACTORIES[name]()
    assert isinstance(policy, VerifyPolicy)
    torch.manual_seed(0)
    c, n = torch.rand(7, 4), torch.randint(0, 5, (7,))
    out = policy.choose(c, n)
    assert out.dtype == torch.int64 and out.shape == (7,)
    assert bool(((out >= 0) & (out <= n)).all())
    empty = policy.choose(torch.zeros(0, 4), counts([]))
    assert empty.shape == (0,)


@pytest.mark.parametrize("name", [name for name in POLICY_FACTORIES if name != "fixed"])
def test_bad_inputs_raise(name: str) -> None:
    policy = POLICY_FACTORIES[name]()
    c, n = torch.full((2, 3), 0.5), counts([3, 3])
    with pytest.raises(ValueError, match="confidence head"):
        policy.choose(None, n)
    with pytest.raises(ValueError, match="shape \\(R, K\\)"):
        policy.choose(c[0], n)
    with pytest.raises(ValueError, match="rows"):
        policy.choose(c, counts([3]))
    with pytest.raises(ValueError, match="<= K"):
        policy.choose(c, counts([4, 3]))
    with pytest.raises(ValueError, match="integer"):
        policy.choose(c, torch.tensor([3.0, 3.0]))
    with pytest.raises(ValueError, match="\\[0, 1\\]"):
        policy.choose(torch.tensor([[0.5, 1.5, 0.5], [0.5, 0.5, 0.5]]), n)
    with pytest.raises(ValueError, match="\\[0, 1\\]"):
        policy.choose(torch.tensor([[0.5, float("nan"), 0.5], [0.5, 0.5, 0.5]]), n)
