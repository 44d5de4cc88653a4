"""Drafter statistics for the simulator: what a drafter proposes, how often it is accepted, what it believes.

Shapes: K = block size (gamma), M = confidence bins per position, D = domains, R = requests in a step.

A drafter is summarised per domain (math, code, chat, or one benchmark each) by

* ``proposal_lengths`` (K + 1,): relative frequency of steps proposing n = 0..K drafts (a neural drafter
  always proposes K; prompt lookup proposes fewer, often none);
* ``conditional_acceptance`` (K,): P(draft k accepted | drafts < k accepted), paper §4.3.1
  (docs/conventions.md §Acceptance metrics);
* optionally ``confidence_bins`` (K lists of [confidence, weight, acceptance]): the calibrated per-step
  confidence c_k (eq. 7 after STS) binned over the steps that reached position k, with the bin's share of
  those steps and its observed acceptance. A simulated draft at position k draws a bin by weight, reports
  its confidence to the verify policy and is accepted with the bin's acceptance, so the simulated head is
  exactly as discriminative and as (mis)calibrated as the measured one. Positions are drawn independently
  (the only dependence kept is the prefix rule of verification). Without bins the drafter has no
  confidence head and the policy gets the adapter's constant fallback.

File format (JSON, ``"kind": "dspark-drafter-stats"``)::

    {"kind": "dspark-drafter-stats", "name": str, "block_size": K, "source": str,
     "domains": {NAME: {"weight": w > 0, "proposal_lengths": [K + 1 numbers >= 0],
                        "conditional_acceptance": [K numbers in [0, 1]],
                        "confidence_bins": null | [[[c, weight, acceptance], ...] x K]}}}

``from_eval_results`` reads the same numbers out of a ``dspark eval`` results.json (its per-benchmark
``stats`` counters and, for drafters with a confidence head, ``confidence.position_bins``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dspark.errors import DSparkError

KIND = "dspark-drafter-stats"
#: |mean bin acceptance - conditional_acceptance| allowed before a file is called inconsistent
CONSISTENCY_TOLERANCE = 0.02


class StatsError(DSparkError):
    """A drafter-statistics or SPS file the simulator cannot use; the message names the file."""


@dataclass(frozen=True)
class DomainStats:
    weight: float
    proposal_lengths: tuple[float, ...]  # (K + 1,)
    conditional_acceptance: tuple[float, ...]  # (K,)
    confidence_bins: tuple[tuple[tuple[float, float, float], ...], ...] | None = None  # K x M x (c, w, acc)


@dataclass(frozen=True)
class DrafterStats:
    name: str
    block_size: int
    domains: Mapping[str, DomainStats]
    source: str = ""

    @property
    def has_confidence(self) -> bool:
        return any(d.confidence_bins is not None for d in self.domains.values())

    def tau_verify_all(self, domain: str) -> float:
        """Expected tau when every proposed draft is verified: 1 + sum_j P(n >= j) prod_{i<=j} p_i."""
        d = self.domains[domain]
        props = np.asarray(d.proposal_lengths) / sum(d.proposal_lengths)
        reach = 1.0 - np.cumsum(props)[:-1]  # (K,) P(n >= j), j = 1..K
        return float(1.0 + (reach * np.cumprod(d.conditional_acceptance)).sum())

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND, "name": self.name, "block_size": self.block_size, "source": self.source,
            "domains": {n: {"weight": d.weight, "proposal_lengths": list(d.proposal_lengths),
                            "conditional_acceptance": list(d.conditional_acceptance),
                            "confidence_bins": None if d.confidence_bins is None
                            else [[list(b) for b in pos] for pos in d.confidence_bins]}
                        for n, d in self.domains.items()},
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()) + "\n", encoding="utf-8")
        return path


# --------------------------------------------------------------------------- validation
def _numbers(value: Any, length: int, what: str, low: float = 0.0, high: float = math.inf) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != length:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{what} must be a list of {length} numbers (block size + its convention), got {got}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
            raise ValueError(f"{what} must hold finite numbers in [{low}, {high}], got {v!r}")
    return tuple(float(v) for v in value)


def _domain(raw: Any, K: int, where: str) -> DomainStats:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object")
    weight = float(raw.get("weight", 1.0))
    if not weight > 0:
        raise ValueError(f"{where}.weight must be > 0, got {weight}")
    props = _numbers(raw.get("proposal_lengths"), K + 1, f"{where}.proposal_lengths")
    if sum(props) <= 0:
        raise ValueError(f"{where}.proposal_lengths must not be all zero")
    cond = _numbers(raw.get("conditional_acceptance"), K, f"{where}.conditional_acceptance", 0.0, 1.0)
    bins = raw.get("confidence_bins")
    if bins is None:
        return DomainStats(weight, props, cond)
    if not isinstance(bins, list) or len(bins) != K:
        raise ValueError(f"{where}.confidence_bins must hold one list per draft position ({K}), "
                         f"got {len(bins) if isinstance(bins, list) else type(bins).__name__}")
    parsed = []
    for k, pos in enumerate(bins):
        if not isinstance(pos, list) or not pos:
            raise ValueError(f"{where}.confidence_bins[{k}] must be a non-empty list of [c, weight, acceptance]")
        rows = [_numbers(b, 3, f"{where}.confidence_bins[{k}] entry", 0.0, 1.0e18) for b in pos]
        conf = [c for c, _, _ in rows]
        if any(c > 1 for c in conf) or any(a > 1 for _, _, a in rows):
            raise ValueError(f"{where}.confidence_bins[{k}]: confidence and acceptance must lie in [0, 1]")
        if any(b <= a for a, b in zip(conf, conf[1:])):
            raise ValueError(f"{where}.confidence_bins[{k}]: bin confidences must be strictly increasing, got {conf}")
        total = sum(w for _, w, _ in rows)
        if total <= 0:
            raise ValueError(f"{where}.confidence_bins[{k}]: weights are all zero")
        mean_acc = sum(w * a for _, w, a in rows) / total
        if abs(mean_acc - cond[k]) > CONSISTENCY_TOLERANCE:
            raise ValueError(f"{where}: position {k + 1} bins accept {mean_acc:.3f} on average but "
                             f"conditional_acceptance says {cond[k]:.3f}; the two come from different runs")
        parsed.append(tuple(rows))
    return DomainStats(weight, props, cond, tuple(parsed))


def stats_from_dict(data: Any, block_size: int | None = None) -> DrafterStats:
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ValueError(f"not a drafter-statistics file (needs \"kind\": \"{KIND}\"); for a `dspark eval` "
                         "results.json give --drafter-name")
    K = data.get("block_size")
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {K!r}")
    if block_size is not None and K != block_size:
        raise ValueError(f"statistics are for block size {K}, but block size {block_size} was asked for")
    domains = data.get("domains")
    if not isinstance(domains, dict) or not domains:
        raise ValueError("domains must be a non-empty object")
    parsed = {str(n): _domain(d, K, f"domains.{n}") for n, d in domains.items()}
    if len({d.confidence_bins is None for d in parsed.values()}) > 1:
        raise ValueError("either every domain has confidence_bins or none has")
    return DrafterStats(str(data.get("name", "drafter")), K, parsed, str(data.get("source", "")))


def from_eval_results(results: Mapping[str, Any], drafter: str, source: str = "") -> DrafterStats:
    """Per-benchmark statistics of one drafter in a ``dspark eval`` results.json (every draft verified)."""
    drafters = results.get("drafters") if isinstance(results, dict) else None
    if not isinstance(drafters, dict) or drafter not in drafters:
        names = sorted(drafters) if isinstance(drafters, dict) else []
        raise ValueError(f"no drafter {drafter!r} in these results (drafters: {names})")
    if (results.get("settings") or {}).get("policy"):
        raise ValueError("these results were run with a verify policy; the simulator needs every draft verified")
    domains = {}
    for bench, summary in drafters[drafter]["benchmarks"].items():
        if not summary.get("num_samples"):
            continue
        K, props, cond = _from_counters(summary["stats"])
        conf = summary.get("confidence") or {}
        bins = conf.get("position_bins")
        domains[bench] = {"weight": 1.0, "proposal_lengths": props, "conditional_acceptance": cond,
                          "confidence_bins": _bins_for(bins, cond) if bins else None}
    if not domains:
        raise ValueError(f"drafter {drafter!r} has no evaluated samples")
    return stats_from_dict({"kind": KIND, "name": drafter, "block_size": K, "source": source, "domains": domains})


def _from_counters(counters: Mapping[str, Any]) -> tuple[int, list[float], list[float]]:
    """An ``AcceptanceStats`` JSON -> (K, proposal-length frequencies (K + 1,), conditional acceptance (K,))."""
    from dspark.generation.stats import AcceptanceStats

    stats = AcceptanceStats(counters["block_size"], counters["counts"], counters["sum_acceptance_length"])
    props = [float(sum(row)) for row in stats.counts]
    cond = [0.0 if math.isnan(p) else p for p in stats.per_position_acceptance()]
    return stats.block_size, props, cond


def per_request_stats(records: list[Mapping[str, Any]], drafter: str, source: str = "") -> DrafterStats:
    """One domain per ``dspark eval`` samples.jsonl record, from the record's own ``stats`` counters, in record
    order: request i of a trace then drafts as record i did, so requests differ as much as the measured ones.
    Records carry no confidence bins: for drafters without a confidence head (every draft's confidence is the
    policy's fallback)."""
    domains, K = {}, None
    for i, rec in enumerate(records):
        counters = rec.get("stats") if isinstance(rec, dict) else None
        if not isinstance(counters, dict):
            raise ValueError(f"record {i + 1} has no \"stats\" counters (a `dspark eval` samples.jsonl has them)")
        k, props, cond = _from_counters(counters)
        if K is not None and k != K:
            raise ValueError(f"record {i + 1} has block size {k}, the first one {K}")
        K = k
        if not any(props):
            props = [1.0] + [0.0] * K  # a request decoded in no step (a one-token answer): it proposes nothing
        domains[f"{i}:{rec.get('dataset', '')}"] = {"weight": 1.0, "proposal_lengths": props,
                                                    "conditional_acceptance": cond, "confidence_bins": None}
    if not domains:
        raise ValueError("no records")
    return stats_from_dict({"kind": KIND, "name": drafter, "block_size": K, "source": source, "domains": domains})


def _bins_for(position_bins: list, cond: list[float]) -> list:
    """eval's position_bins ({"c", "count", "accepted"} per bin) -> [c, weight, acceptance]; empty positions
    (never reached) get one bin at the conditional acceptance."""
    out = []
    for k, pos in enumerate(position_bins):
        rows = [[b["c"], b["count"], b["accepted"] / b["count"]] for b in pos if b["count"] > 0]
        out.append(rows or [[cond[k], 1.0, cond[k]]])
    return out


def load_stats(path: str | Path, drafter: str | None = None, block_size: int | None = None) -> DrafterStats:
    """A drafter-statistics JSON, or a ``dspark eval`` results.json with ``drafter`` naming the drafter."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StatsError(f"{path}: no such statistics file (write one with `dspark eval`)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StatsError(f"{path}: not valid JSON ({err})") from None
    try:
        if isinstance(data, dict) and data.get("kind") != KIND and "drafters" in data:
            names = sorted(data["drafters"]) if isinstance(data["drafters"], dict) else []
            if drafter is None and len(names) != 1:
                raise ValueError(f"holds drafters {names}; choose one with --drafter-name")
            stats = from_eval_results(data, drafter or names[0], str(path))
            if block_size is not None and stats.block_size != block_size:
                raise ValueError(f"statistics are for block size {stats.block_size}, not {block_size}")
            return stats
        return stats_from_dict(data, block_size)
    except (ValueError, KeyError, TypeError) as err:
        raise StatsError(f"{path}: {err}") from None


# --------------------------------------------------------------------------- sampling
class DraftSampler:
    """Draws a step's proposals for R requests from their domains' statistics, vectorised (numpy)."""

    def __init__(self, stats: DrafterStats) -> None:
        self.stats = stats
        self.names = list(stats.domains)
        doms = [stats.domains[n] for n in self.names]
        K = stats.block_size
        w = np.array([d.weight for d in doms])
        self.domain_p = w / w.sum()  # (D,)
        props = np.array([d.proposal_lengths for d in doms], dtype=np.float64)  # (D, K + 1)
        self.prop_cdf = np.cumsum(props / props.sum(1, keepdims=True), axis=1)  # (D, K + 1)
        M = max((len(pos) for d in doms if d.confidence_bins for pos in d.confidence_bins), default=1)
        self.conf = np.full((len(doms), K, M), np.nan)  # (D, K, M)
        self.bin_cdf = np.ones((len(doms), K, M))  # (D, K, M)
        self.accept = np.zeros((len(doms), K, M))  # (D, K, M)
        for i, d in enumerate(doms):
            for k in range(K):
                rows = d.confidence_bins[k] if d.confidence_bins else ((math.nan, 1.0, d.conditional_acceptance[k]),)
                c, wk, acc = (np.array(x, dtype=np.float64) for x in zip(*rows))
                m = len(rows)
                self.conf[i, k, :m], self.accept[i, k, :m] = c, acc
                self.bin_cdf[i, k, :m] = np.cumsum(wk / wk.sum())
        self.bin_cdf[..., -1] = 1.0  # guard against rounding
        # every (domain, position) CDF shifted by 2 x its row index into one increasing array: one searchsorted
        # then finds the bins of all R x K draws at once (u + 2 x row lies inside row's own stretch)
        D, M = len(doms), self.conf.shape[2]
        self._row = np.arange(D * K).reshape(D, K)  # (D, K) row index of (domain, position)
        self._flat_cdf = (self.bin_cdf + 2.0 * self._row[..., None]).reshape(-1)  # (D * K * M,)

    def draw_domains(self, n: int, rng: np.random.Generator) -> np.ndarray:  # (n,) domain index
        return rng.choice(len(self.names), size=n, p=self.domain_p)

    def draw(self, domains: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """num_tokens (R,), confidences (R, K) or None, accepted flags (R, K) for requests of ``domains`` (R,)."""
        R, K = len(domains), self.stats.block_size
        num_tokens = (rng.random((R, 1)) >= self.prop_cdf[domains]).sum(1).clip(max=K)  # (R,)
        u = rng.random((R, K))
        M = self.conf.shape[2]
        row = self._row[domains]  # (R, K)
        # the first bin whose CDF exceeds u (as counting the CDF values <= u), within the row's stretch
        idx = (np.searchsorted(self._flat_cdf, u + 2.0 * row, side="right") - row * M).clip(max=M - 1)  # (R, K)
        pick = (domains[:, None], np.arange(K)[None, :], idx)
        accepted = rng.random((R, K)) < self.accept[pick]  # (R, K)
        confidences = self.conf[pick] if self.stats.has_confidence else None  # (R, K)
        return num_tokens, confidences, accepted
