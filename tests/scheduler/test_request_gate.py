"""The request-level draft gate: which requests of a plain step draft (``dspark.scheduler.request_gate``)."""

from __future__ import annotations

import itertools
import random

import pytest

from dspark.scheduler.request_gate import MIN_OWN_STEPS, drafting_subset, own_acceptance


def _rate(acceptance, chosen, plain_s, marginal_s) -> float:
    picked = [a for a, c in zip(acceptance, chosen) if c]
    return (len(acceptance) + sum(a - 1 for a in picked)) / (plain_s + marginal_s * len(picked))


def test_the_subset_is_the_best_of_all_subsets_of_known_requests() -> None:
    rng = random.Random(0)
    for _ in range(300):
        R = rng.randint(1, 7)
        acceptance = [None if rng.random() < 0.2 else 1 + 3 * rng.random() for _ in range(R)]
        plain_s, marginal_s = rng.uniform(0.01, 0.1), rng.uniform(0.001, 0.05)
        chosen = drafting_subset(acceptance, plain_s, marginal_s)
        assert not any(c for a, c in zip(acceptance, chosen) if a is None)  # unknown requests never draft here
        known = [r for r in range(R) if acceptance[r] is not None]
        best = max(_rate(acceptance, [r in subset for r in range(R)], plain_s, marginal_s)
                   for k in range(len(known) + 1) for subset in itertools.combinations(known, k))
        assert _rate(acceptance, chosen, plain_s, marginal_s) == pytest.approx(best)


def test_a_request_drafts_where_its_acceptance_pays_for_its_cost() -> None:
    # 4 requests, a plain step 30 ms (133 tokens/s); one more drafting request adds 10 ms: it pays from
    # 1 + 4 * 10 / 30 = 2.33 tokens per step
    assert drafting_subset([3.2, 1.3, 2.0, None], 0.030, 0.010) == [True, False, False, False]
    # 2 requests: the first pays from 1 + 2 * 10 / 30 = 1.67; then the step makes 3.3 tokens in 40 ms, and the
    # second's 1.3 / 10 ms still beats that
    assert drafting_subset([2.3, 2.3], 0.030, 0.010) == [True, True]
    assert drafting_subset([2.3, 2.3], 0.030, 0.030) == [False, False]  # it would pay from 1 + 2 = 3
    assert drafting_subset([1.5, 1.5], 0.030, 0.030) == [False, False]
    assert drafting_subset([], 0.03, 0.01) == [] and drafting_subset([3.0], 0.03, 0.0) == [False]


def test_own_acceptance_needs_a_few_steps() -> None:
    assert own_acceptance(MIN_OWN_STEPS - 1, 8) is None
    assert own_acceptance(MIN_OWN_STEPS, 6) == 6 / MIN_OWN_STEPS
