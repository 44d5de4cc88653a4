"""Bootstrap intervals of tau: the replicate statistic against a loop, coverage on a known law, pairing."""

import numpy as np
import pytest

from dspark.evaluation import intervals
from dspark.evaluation.intervals import paired_difference, tau_intervals

K = 7


def _record(drafter, dataset, idx, committed, steps):
    counts = [[0] * (K + 1) for _ in range(K + 1)]
    counts[K][0] = steps  # the histogram only has to hold the number of steps
    return {"drafter": drafter, "dataset": dataset, "idx": idx, "row": 0,
            "stats": {"block_size": K, "counts": counts, "sum_acceptance_length": committed}}


def _results(drafters, domains):
    return {"drafters": {d: {} for d in drafters}, "domains": domains}


def test_replicate_statistic_matches_a_loop():
    rng = np.random.default_rng(3)
    committed = rng.integers(10, 200, size=9).astype(float)
    steps = rng.integers(5, 80, size=9).astype(float)
    weights = intervals._resample_weights(9, 50, np.random.default_rng(0))
    fast = intervals._pooled(weights, committed, steps)
    for b in range(50):
        drawn = [i for i in range(9) for _ in range(int(weights[b, i]))]
        assert len(drawn) == 9
        slow = sum(committed[i] for i in drawn) / sum(steps[i] for i in drawn)
        assert fast[b] == pytest.approx(slow)


def test_constant_tau_gives_a_point_interval():
    records = [_record("d", "gsm8k", i, 2 * s, s) for i, s in enumerate([10, 20, 30, 40])]
    ci = tau_intervals(records, _results(["d"], {"math": ["gsm8k"]}))["d"]
    assert ci["benchmarks"]["gsm8k"] == pytest.approx([2.0, 2.0])
    assert ci["overall"] == pytest.approx([2.0, 2.0])


def _coverage(width: float = 1.0, trials: int = 200) -> float:
    """Share of evaluations (40 prompts with tau ~ N(2.0, 0.4), equal steps) whose interval, scaled by ``width``
    about its middle, holds the true 2.0."""
    rng = np.random.default_rng(11)
    hits = 0
    for t in range(trials):
        taus = rng.normal(2.0, 0.4, size=40)
        records = [_record("d", "gsm8k", i, int(round(100 * x)), 100) for i, x in enumerate(taus)]
        lo, hi = tau_intervals(records, _results(["d"], {"math": ["gsm8k"]}), replicates=400, seed=t)["d"]["overall"]
        mid, half = (lo + hi) / 2, width * (hi - lo) / 2
        hits += mid - half <= 2.0 <= mid + half
    return hits / trials


def test_interval_covers_the_true_mean_about_95_percent():
    assert 0.9 <= _coverage() <= 0.99


def test_negative_control_a_narrow_interval_undercovers():
    """The same check fails for an interval a third as wide: the coverage test can tell."""
    assert not 0.9 <= _coverage(width=1 / 3) <= 0.99


def test_interval_narrows_with_more_prompts():
    rng = np.random.default_rng(5)
    taus = rng.normal(2.0, 0.5, size=10)
    few = [_record("d", "gsm8k", i, int(100 * x), 100) for i, x in enumerate(taus)]
    many = [_record("d", "gsm8k", i, int(100 * taus[i % 10]), 100) for i in range(160)]
    doms = _results(["d"], {"math": ["gsm8k"]})
    w_few = np.diff(tau_intervals(few, doms)["d"]["overall"])[0]
    w_many = np.diff(tau_intervals(many, doms)["d"]["overall"])[0]
    assert w_many == pytest.approx(w_few / 4, rel=0.35)  # 16x the prompts: a quarter of the width


def test_domains_and_overall_are_macro_means():
    records = [_record("d", "gsm8k", i, 30, 10) for i in range(5)] + \
              [_record("d", "math500", i, 20, 10) for i in range(5)] + \
              [_record("d", "mt-bench", i, 15, 10) for i in range(5)]
    ci = tau_intervals(records, _results(["d"], {"math": ["gsm8k", "math500"], "chat": ["mt-bench"]}))["d"]
    assert ci["domains"]["math"] == pytest.approx([2.5, 2.5])
    assert ci["overall"] == pytest.approx([2.0, 2.0])  # (2.5 + 1.5) / 2


def test_paired_difference_sees_a_small_shift_that_unpaired_intervals_overlap():
    rng = np.random.default_rng(2)
    taus = rng.uniform(1.2, 3.5, size=12)  # prompts differ much more than the drafters do
    records = []
    for i, x in enumerate(taus):
        records.append(_record("base", "gsm8k", i, int(round(100 * x)), 100))
        records.append(_record("new", "gsm8k", i, int(round(100 * (x + 0.1))), 100))
    res = _results(["base", "new"], {"math": ["gsm8k"]})
    ci = tau_intervals(records, res)
    assert ci["new"]["overall"][0] < ci["base"]["overall"][1]  # unpaired intervals overlap
    diff = paired_difference(records, res, "new", "base")
    assert diff["overall"]["difference"] == pytest.approx(0.1, abs=0.01)
    assert diff["better"] and not diff["worse"]
    reverse = paired_difference(records, res, "base", "new")
    assert reverse["worse"] and not reverse["better"]


def test_negative_control_equal_drafters_are_rarely_called_different():
    """Two drafters of the same law: a 95 % paired interval excludes 0 in about 5 % of evaluations (a test that
    called every small shift 'better' would fail here)."""
    rng = np.random.default_rng(5)
    calls, trials = 0, 150
    for t in range(trials):
        records = []
        for i in range(12):
            for name in ("a", "b"):  # the same law, independent draws
                records.append(_record(name, "gsm8k", i, int(round(100 * rng.normal(2.0, 0.3))), 100))
        diff = paired_difference(records, _results(["a", "b"], {"math": ["gsm8k"]}), "b", "a", replicates=1000,
                                 seed=t)
        calls += diff["better"] or diff["worse"]
    assert calls / trials <= 0.11  # 5 % expected; a plain percentile interval of 12 prompts calls about 13 %


def test_expanded_level_matches_t_intervals():
    """The width correction for few prompts: z of the expanded level = sqrt(n / (n - 1)) t_{n-1}."""
    from statistics import NormalDist

    from dspark.evaluation.intervals import _t_quantile, expanded_level

    for dof, t in ((4, 2.776), (9, 2.262), (11, 2.201), (79, 1.990)):  # t tables, 97.5 %
        assert _t_quantile(0.975, dof) == pytest.approx(t, abs=2e-3)
    z = NormalDist().inv_cdf((1 + expanded_level(0.95, 12)) / 2)
    assert z == pytest.approx((12 / 11) ** 0.5 * 2.201, abs=2e-3)
    assert expanded_level(0.95, 10_000) == pytest.approx(0.95, abs=1e-3)  # many prompts: the plain level


def test_paired_difference_uses_only_shared_prompts():
    records = [_record("a", "gsm8k", i, 20, 10) for i in range(6)] + \
              [_record("b", "gsm8k", i, 30, 10) for i in range(3)]
    diff = paired_difference(records, _results(["a", "b"], {"math": ["gsm8k"]}), "b", "a")
    assert diff["overall"]["difference"] == pytest.approx(1.0)
    assert diff["overall"]["interval"] == pytest.approx([1.0, 1.0])
