"""95 % intervals for acceptance length: a bootstrap over prompts.

A benchmark's tau pools every step of every sample (sum of tau / number of steps, ``runner.DEFINITIONS``), so
one replicate redraws the benchmark's prompts with replacement and pools again; domains and overall are then
the same macro means of the replicate's benchmark values as in ``runner.aggregate``. Prompts are redrawn
within each benchmark (a stratified bootstrap), so every replicate keeps every benchmark.

``paired_difference`` compares two drafters evaluated on the same prompts: each replicate redraws the prompts
once and uses them for both, so the noise that the prompts share (an easy prompt is easy for both) cancels.
"Better" means the difference's interval lies above 0.

Percentile intervals of few prompts are too narrow, so every interval is Hesterberg's expanded percentile one
(``expanded_level``): the quantiles are taken at the level whose normal width equals a t interval's over the
prompts behind it (a benchmark's, a domain's or all of them).

Shapes: B = bootstrap replicates, n = prompts of one benchmark.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Mapping, Sequence

import numpy as np

DEFAULT_REPLICATES = 2000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0


def _steps(stats: Mapping[str, Any]) -> int:
    return int(sum(sum(row) for row in stats["counts"]))


def prompt_totals(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], dict[tuple[int, int], tuple[int, int]]]:
    """(drafter, benchmark) -> {(idx, row): (committed tokens, steps)} from ``samples.jsonl`` records."""
    out: dict[tuple[str, str], dict[tuple[int, int], tuple[int, int]]] = {}
    for r in records:
        stats = r["stats"]
        out.setdefault((str(r["drafter"]), str(r["dataset"])), {})[(int(r["idx"]), int(r["row"]))] = (
            int(stats["sum_acceptance_length"]), _steps(stats))
    return out


def _resample_weights(n: int, replicates: int, rng: np.random.Generator) -> np.ndarray:  # (B, n)
    """How often each of n prompts is drawn in each replicate (rows sum to n)."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=replicates).astype(np.float64)


def _pooled(weights: np.ndarray, committed: np.ndarray, steps: np.ndarray) -> np.ndarray:  # (B,)
    """Pooled tau per replicate; a replicate that drew only step-less prompts gives NaN."""
    total_steps = weights @ steps  # (B,)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total_steps > 0, (weights @ committed) / total_steps, np.nan)


def _macro(columns: Sequence[np.ndarray]) -> np.ndarray:  # (B,)
    return np.nanmean(np.stack(columns), axis=0) if columns else np.array([np.nan])


def _t_quantile(p: float, dof: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (Abramowitz & Stegun 26.7.5;
    within 1e-3 from 5 degrees of freedom)."""
    z = NormalDist().inv_cdf(p)
    v = float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4))


def expanded_level(level: float, n: int) -> float:
    """The percentile level that makes a bootstrap interval of a mean over ``n`` prompts as wide as a t interval
    (Hesterberg's expanded percentile interval): a plain percentile bootstrap is too narrow for few prompts (it
    uses the (n-1)/n-biased variance and normal tails; with 12 prompts a 95 % interval holds the truth about
    87 % of the time, ``tests/evaluation/test_intervals.py``)."""
    if n < 3:
        return level
    z = math.sqrt(n / (n - 1)) * _t_quantile((1 + level) / 2, n - 1)
    return min(2 * NormalDist().cdf(z) - 1, 1 - 1e-9)


def _interval(values: np.ndarray, level: float, n: int = 0) -> list[float] | None:
    values = values[~np.isnan(values)]
    if values.size == 0:
        return None
    level = expanded_level(level, n)
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def _replicates(
    totals: Sequence[Mapping[tuple[int, int], tuple[int, int]]], keys: list[tuple[int, int]], replicates: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """For each per-prompt mapping in ``totals`` (all holding ``keys``): pooled tau per replicate (B,), every
    mapping resampled with the same draws."""
    weights = _resample_weights(len(keys), replicates, rng)  # (B, n), shared by every drafter
    out = []
    for per_prompt in totals:
        committed = np.array([per_prompt[k][0] for k in keys], dtype=np.float64)  # (n,)
        steps = np.array([per_prompt[k][1] for k in keys], dtype=np.float64)  # (n,)
        out.append(_pooled(weights, committed, steps))
    return out


def tau_intervals(
    records: Sequence[Mapping[str, Any]], results: Mapping[str, Any], *, replicates: int = DEFAULT_REPLICATES,
    level: float = DEFAULT_LEVEL, seed: int = DEFAULT_SEED,
) -> dict[str, dict[str, Any]]:
    """Per drafter: {"benchmarks": {name: [lo, hi]}, "domains": {dom: [lo, hi]}, "overall": [lo, hi]} for the
    acceptance length, from the records the ``results`` dict was aggregated from (same selection)."""
    totals = prompt_totals(records)
    domains: Mapping[str, Sequence[str]] = results["domains"]
    out: dict[str, dict[str, Any]] = {}
    for name in results["drafters"]:
        rng = np.random.default_rng(seed)
        bench: dict[str, np.ndarray] = {}
        count: dict[str, int] = {}  # prompts per benchmark
        for names in domains.values():
            for b in names:
                per_prompt = totals.get((name, b))
                if per_prompt:
                    bench[b] = _replicates([per_prompt], sorted(per_prompt), replicates, rng)[0]
                    count[b] = len(per_prompt)
        dom = {d: _macro([bench[b] for b in names if b in bench]) for d, names in domains.items()}
        dom = {d: v for d, v in dom.items() if not np.isnan(v).all()}
        dom_n = {d: sum(count.get(b, 0) for b in domains[d]) for d in dom}
        out[name] = {
            "benchmarks": {b: _interval(v, level, count[b]) for b, v in bench.items()},
            "domains": {d: _interval(v, level, dom_n[d]) for d, v in dom.items()},
            "overall": _interval(_macro(list(dom.values())), level, sum(dom_n.values())) if dom else None,
        }
    return out


def paired_difference(
    records: Sequence[Mapping[str, Any]], results: Mapping[str, Any], drafter: str, baseline: str, *,
    replicates: int = DEFAULT_REPLICATES, level: float = DEFAULT_LEVEL, seed: int = DEFAULT_SEED,
) -> dict[str, Any]:
    """tau(drafter) - tau(baseline) with a paired bootstrap interval, per domain and overall, on the prompts
    both evaluated. ``better``: the overall interval lies above 0; ``worse``: below 0."""
    totals = prompt_totals(records)
    domains: Mapping[str, Sequence[str]] = results["domains"]
    rng = np.random.default_rng(seed)
    diffs: dict[str, np.ndarray] = {}
    points: dict[str, float] = {}
    count: dict[str, int] = {}
    for names in domains.values():
        for b in names:
            mine, base = totals.get((drafter, b), {}), totals.get((baseline, b), {})
            keys = sorted(set(mine) & set(base))
            if not keys:
                continue
            a, c = _replicates([mine, base], keys, replicates, rng)
            diffs[b] = a - c
            points[b] = _point(mine, keys) - _point(base, keys)
            count[b] = len(keys)
    dom = {d: _macro([diffs[b] for b in names if b in diffs]) for d, names in domains.items()}
    dom = {d: v for d, v in dom.items() if not np.isnan(v).all()}
    dom_n = {d: sum(count.get(b, 0) for b in domains[d]) for d in dom}
    dom_points = {d: float(np.mean([points[b] for b in names if b in points]))
                  for d, names in domains.items() if d in dom}
    overall = _macro(list(dom.values()))
    interval = _interval(overall, level, sum(dom_n.values())) if dom else None
    return {
        "drafter": drafter, "baseline": baseline, "level": level, "replicates": replicates,
        "domains": {d: {"difference": dom_points[d], "interval": _interval(v, level, dom_n[d])}
                    for d, v in dom.items()},
        "overall": {"difference": float(np.mean(list(dom_points.values()))) if dom_points else None,
                    "interval": interval},
        "better": bool(interval and interval[0] > 0),
        "worse": bool(interval and interval[1] < 0),
    }


def _point(per_prompt: Mapping[tuple[int, int], tuple[int, int]], keys: list[tuple[int, int]]) -> float:
    steps = sum(per_prompt[k][1] for k in keys)
    return sum(per_prompt[k][0] for k in keys) / steps if steps else float("nan")
