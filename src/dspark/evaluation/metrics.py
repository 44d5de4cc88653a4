"""Acceptance statistics and confidence-head metrics (pure functions, no model code).

Shapes: N = speculative steps (rows), K = draft positions per block (gamma).
Position k is 0-based here; papers and plots say "draft position k+1".

Two families:

* ``AcceptanceStats`` accumulates, per speculative step, how many draft tokens
  were verified (``proposal_len``), how many of them were accepted
  (``num_accepted``) and how many tokens the step committed
  (``acceptance_length`` = accepted + 1 bonus token, or just accepted when an
  EOS inside the accepted drafts ended generation). It keeps a joint histogram,
  so its memory does not grow with the number of steps. It reports both acceptance
  curves: DeepSpec's prefix acceptance ``accept_rate@k`` (interop-facts §3) and
  the per-position conditional acceptance of paper §4.3.1 (DESIGN.md §2).
* Confidence metrics on the confidence head's cumulative prediction
  ``survival_k = prod_{j<=k} sigmoid(logit_j / T_j)`` against the label "drafts
  0..k were all accepted" (DESIGN.md §1.2, interop-facts §3): ``ece``,
  ``auroc``, ``brier`` and ``confidence_report``.

Arrays may be numpy arrays, torch tensors or sequences; everything is computed
in float64 numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

EPS_PROB = 1e-8  # predictions are clamped to [EPS_PROB, 1 - EPS_PROB] (DeepSpec, SGLang)
DEFAULT_ECE_BINS = 20  # DeepSpec's evaluator; SGLang's STS fitter uses 15

ArrayLike = Any  # np.ndarray | torch.Tensor | Sequence[float]


def to_numpy(x: ArrayLike, dtype: type = np.float64) -> np.ndarray:
    """A float64 (or ``dtype``) numpy copy of a tensor, array or sequence."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy().astype(dtype, copy=False)  # bf16 has no numpy dtype
    return np.asarray(x, dtype=dtype)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


# --------------------------------------------------------------------------- acceptance


@dataclass
class AcceptanceStats:
    """Per-step acceptance counters for one drafter on one dataset.

    ``counts[p][a]`` = #steps that verified ``p`` draft tokens and accepted ``a``
    of them (0 <= a <= p <= K): a (K+1)^2 joint histogram, so memory does not
    grow with the number of steps and both acceptance curves can be derived.
    """

    block_size: int  # K (gamma)
    counts: list[list[int]] = field(default_factory=list)  # (K+1, K+1)
    sum_acceptance_length: int = 0  # committed tokens, bonus included

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        size = self.block_size + 1
        if not self.counts:
            self.counts = [[0] * size for _ in range(size)]
        elif len(self.counts) != size or any(len(row) != size for row in self.counts):
            raise ValueError(f"counts must be a {size}x{size} table (block_size + 1 square)")
        elif any(self.counts[p][a] for p in range(size) for a in range(p + 1, size)):
            raise ValueError("counts[p][a] must be 0 when a > p (more accepted than proposed)")

    # ---- accumulation

    def add_step(self, proposal_len: int, num_accepted: int, acceptance_length: int) -> None:
        """Record one speculative step of one request."""
        if not 0 <= num_accepted <= proposal_len <= self.block_size:
            raise ValueError(
                f"need 0 <= num_accepted ({num_accepted}) <= proposal_len ({proposal_len}) "
                f"<= block_size ({self.block_size})"
            )
        if acceptance_length not in (num_accepted, num_accepted + 1) or acceptance_length < 1:
            raise ValueError(
                f"acceptance_length ({acceptance_length}) must be num_accepted + 1 (bonus token) "
                f"or num_accepted >= 1 (step ended on an accepted EOS); num_accepted = {num_accepted}"
            )
        self.counts[proposal_len][num_accepted] += 1
        self.sum_acceptance_length += acceptance_length

    def add_steps(
        self,
        proposal_len: ArrayLike,  # (N,) int
        num_accepted: ArrayLike,  # (N,) int
        acceptance_length: ArrayLike,  # (N,) int
    ) -> None:
        """Record many steps at once (one host transfer for a whole batch)."""
        proposal = to_numpy(proposal_len, np.int64).ravel()
        accepted = to_numpy(num_accepted, np.int64).ravel()
        length = to_numpy(acceptance_length, np.int64).ravel()
        if not proposal.shape == accepted.shape == length.shape:
            raise ValueError("proposal_len, num_accepted and acceptance_length must have the same length")
        if ((accepted < 0) | (accepted > proposal) | (proposal > self.block_size)).any():
            raise ValueError(f"need 0 <= num_accepted <= proposal_len <= block_size ({self.block_size})")
        if (((length != accepted) & (length != accepted + 1)) | (length < 1)).any():
            raise ValueError("acceptance_length must be num_accepted + 1 (bonus) or num_accepted (EOS)")
        size = self.block_size + 1
        joint = np.bincount(proposal * size + accepted, minlength=size * size).reshape(size, size)
        for p, row in enumerate(joint.tolist()):
            for a, c in enumerate(row):
                self.counts[p][a] += c
        self.sum_acceptance_length += int(length.sum())

    def merge(self, other: AcceptanceStats) -> None:
        """Add ``other``'s counts into ``self`` (across requests, datasets or ranks)."""
        if other.block_size != self.block_size:
            raise ValueError(f"cannot merge block_size {other.block_size} into block_size {self.block_size}")
        for p in range(self.block_size + 1):
            for a in range(p + 1):
                self.counts[p][a] += other.counts[p][a]
        self.sum_acceptance_length += other.sum_acceptance_length

    def _count(self, proposal_min: int, accepted_min: int) -> int:
        """#steps with proposal_len >= proposal_min and num_accepted >= accepted_min."""
        return sum(
            self.counts[p][a]
            for p in range(proposal_min, self.block_size + 1)
            for a in range(accepted_min, p + 1)
        )

    # ---- summaries

    @property
    def num_steps(self) -> int:
        return self._count(0, 0)

    @property
    def num_proposed(self) -> int:
        """Draft tokens verified, summed over steps."""
        return sum(p * sum(row) for p, row in enumerate(self.counts))

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted, summed over steps."""
        return sum(a * c for row in self.counts for a, c in enumerate(row))

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per step, tau (bonus included)."""
        return self.sum_acceptance_length / self.num_steps if self.num_steps else math.nan

    @property
    def mean_proposal_len(self) -> float:
        """Mean draft tokens verified per step (DeepSpec prints it as "x.xx+1")."""
        return self.num_proposed / self.num_steps if self.num_steps else math.nan

    @property
    def verify_rate(self) -> float:
        """Committed tokens per verified position: sum tau / (sum proposal_len + #steps)."""
        denom = self.num_proposed + self.num_steps
        return self.sum_acceptance_length / denom if denom else math.nan

    def _check_position(self, k: int) -> None:
        if not 0 <= k < self.block_size:
            raise ValueError(f"draft position k must be in [0, {self.block_size}), got {k}")

    def prefix_acceptance(self, k: int) -> float:
        """#(num_accepted > k) / #(proposal_len > k), 0-based draft position k.

        P(drafts 0..k all accepted | draft k verified): DeepSpec's ``accept_rate@k``
        (interop-facts §3), pooled over steps. When every step verifies all K drafts
        it is exactly the product of ``conditional_acceptance(j)`` for j <= k.
        NaN if position k was never verified.
        """
        self._check_position(k)
        proposed = self._count(k + 1, 0)
        return self._count(k + 1, k + 1) / proposed if proposed else math.nan

    def conditional_acceptance(self, k: int) -> float:
        """#(num_accepted > k) / #(num_accepted >= k and proposal_len > k).

        P(draft k accepted | drafts < k accepted, draft k verified): the
        per-position conditional acceptance of paper §4.3.1 / DESIGN.md §2 (Fig. 2).
        NaN if no step reached draft k.
        """
        self._check_position(k)
        reached = self._count(k + 1, k)
        return self._count(k + 1, k + 1) / reached if reached else math.nan

    def prefix_acceptance_curve(self) -> list[float]:
        """``prefix_acceptance(k)`` for k = 0..K-1 (DeepSpec's table columns)."""
        return [self.prefix_acceptance(k) for k in range(self.block_size)]

    def per_position_acceptance(self) -> list[float]:
        """``conditional_acceptance(k)`` for k = 0..K-1 (paper Fig. 2 curves)."""
        return [self.conditional_acceptance(k) for k in range(self.block_size)]

    # ---- serialisation

    _DERIVED_KEYS = (
        "num_steps",
        "acceptance_length",
        "mean_proposal_len",
        "verify_rate",
        "prefix_acceptance",
        "per_position_acceptance",
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready counters plus derived summaries (undefined rates are ``None``)."""

        def clean(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {
            "block_size": self.block_size,
            "counts": [list(row) for row in self.counts],
            "sum_acceptance_length": self.sum_acceptance_length,
            "num_steps": self.num_steps,
            "acceptance_length": clean(self.acceptance_length),
            "mean_proposal_len": clean(self.mean_proposal_len),
            "verify_rate": clean(self.verify_rate),
            "prefix_acceptance": [clean(x) for x in self.prefix_acceptance_curve()],
            "per_position_acceptance": [clean(x) for x in self.per_position_acceptance()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceStats:
        """Inverse of ``to_dict``; derived keys are ignored, unknown keys are errors."""
        counters = ("block_size", "counts", "sum_acceptance_length")
        unknown = set(data) - set(counters) - set(cls._DERIVED_KEYS)
        if unknown:
            raise ValueError(f"unknown AcceptanceStats keys {sorted(unknown)}; expected {list(counters)}")
        missing = [k for k in counters if k not in data]
        if missing:
            raise ValueError(f"AcceptanceStats dict is missing {missing}")
        return cls(
            block_size=int(data["block_size"]),
            counts=[[int(c) for c in row] for row in data["counts"]],
            sum_acceptance_length=int(data["sum_acceptance_length"]),
        )


# --------------------------------------------------------------------------- confidence


def _pred_label(pred: ArrayLike, label: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    pred_np, label_np = to_numpy(pred).ravel(), to_numpy(label).ravel()
    if pred_np.shape != label_np.shape:
        raise ValueError(f"pred and label must have the same size, got {pred_np.size} and {label_np.size}")
    return pred_np, label_np


@dataclass
class ReliabilityBins:
    """Equal-width bins over [0, 1]; empty bins have count 0 and NaN means."""

    count: np.ndarray  # (n_bins,)
    pred_mean: np.ndarray  # (n_bins,)
    label_mean: np.ndarray  # (n_bins,)

    @property
    def edges(self) -> np.ndarray:  # (n_bins + 1,)
        return np.linspace(0.0, 1.0, len(self.count) + 1)


def reliability_bins(pred: ArrayLike, label: ArrayLike, n_bins: int = DEFAULT_ECE_BINS) -> ReliabilityBins:
    """Bin i holds predictions in [i/n, (i+1)/n); a prediction of exactly 1 goes to the last bin."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    pred_np, label_np = _pred_label(pred, label)
    idx = np.clip((pred_np * n_bins).astype(np.int64), 0, n_bins - 1)  # as DeepSpec / SGLang
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        pred_mean = np.bincount(idx, weights=pred_np, minlength=n_bins) / count
        label_mean = np.bincount(idx, weights=label_np, minlength=n_bins) / count
    return ReliabilityBins(count=count, pred_mean=pred_mean, label_mean=label_mean)


def ece(pred: ArrayLike, label: ArrayLike, n_bins: int = DEFAULT_ECE_BINS) -> float:
    """Expected calibration error: sum_b (n_b / n) |mean pred_b - mean label_b|. NaN if empty."""
    bins = reliability_bins(pred, label, n_bins)
    total = bins.count.sum()
    if total == 0:
        return math.nan
    filled = bins.count > 0
    gap = np.abs(bins.pred_mean[filled] - bins.label_mean[filled])
    return float((bins.count[filled] * gap).sum() / total)


def auroc(pred: ArrayLike, label: ArrayLike) -> float:
    """Exact area under the ROC curve (Mann-Whitney U), a tied pos/neg pair counting 1/2.

    ``label`` must be 0/1. NaN when only one class is present.
    """
    pred_np, label_np = _pred_label(pred, label)
    if not np.isin(label_np, (0.0, 1.0)).all():
        raise ValueError("auroc needs binary labels (0 or 1)")
    n_pos = int(label_np.sum())
    n_neg = label_np.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, tie_counts = np.unique(pred_np, return_inverse=True, return_counts=True)
    mid_rank = np.cumsum(tie_counts) - (tie_counts - 1) / 2.0  # 1-based average rank of each tie group
    rank_sum_pos = mid_rank[inverse][label_np == 1.0].sum()
    return float((rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(pred: ArrayLike, label: ArrayLike) -> float:
    """Mean squared error of the probability. NaN if empty."""
    pred_np, label_np = _pred_label(pred, label)
    return float(np.mean((pred_np - label_np) ** 2)) if pred_np.size else math.nan


def prefix_labels(
    accepted: ArrayLike,  # (N,) num_accepted, or (N, K) per-draft accept flags
    block_size: int,
) -> np.ndarray:  # (N, K) bool: drafts 0..k all accepted
    """Label of position k: every draft 0..k was accepted."""
    acc = to_numpy(accepted)
    if acc.ndim == 1:
        return np.arange(block_size)[None, :] < acc[:, None]
    if acc.ndim == 2 and acc.shape[1] == block_size:
        return np.cumprod(acc != 0, axis=1).astype(bool)
    raise ValueError(f"accepted must be (N,) num_accepted or (N, {block_size}) flags, got shape {acc.shape}")


def survival_by_position(
    conf_logits: ArrayLike,  # (N, K) raw confidence-head logits
    proposed_mask: ArrayLike,  # (N, K) bool: draft k was verified in this step
    accepted: ArrayLike,  # (N,) num_accepted or (N, K) accept flags
    temperatures: Sequence[float] | None = None,  # (K,) STS temperatures; None = all 1
) -> list[tuple[np.ndarray, np.ndarray]]:  # K x ((n_k,), (n_k,))
    """Per position k: (survival_k, label_k) over the rows where draft k was verified.

    survival_k = prod_{j<=k} sigmoid(logit_j / T_j) clamped to [1e-8, 1 - 1e-8]
    (DESIGN.md §1.2, eq. 7 with STS); label_k = drafts 0..k all accepted.
    """
    logits = to_numpy(conf_logits)
    if logits.ndim != 2:
        raise ValueError(f"conf_logits must be (N, K), got shape {logits.shape}")
    n, k_max = logits.shape
    mask = to_numpy(proposed_mask, bool)
    if mask.shape != (n, k_max):
        raise ValueError(f"proposed_mask must have shape {(n, k_max)}, got {mask.shape}")
    labels = prefix_labels(accepted, k_max)
    if labels.shape[0] != n:
        raise ValueError(f"accepted has {labels.shape[0]} rows, conf_logits has {n}")
    if (labels & ~mask).any():
        raise ValueError("a draft is marked accepted at a position that was not proposed; check proposed_mask")
    temps = np.ones(k_max) if temperatures is None else to_numpy(temperatures)
    if temps.shape != (k_max,) or not (temps > 0).all():
        raise ValueError(f"temperatures must be {k_max} positive values, got {temperatures}")
    survival = np.clip(np.cumprod(sigmoid(logits / temps), axis=1), EPS_PROB, 1.0 - EPS_PROB)  # (N, K)
    return [(survival[mask[:, k], k], labels[mask[:, k], k].astype(np.float64)) for k in range(k_max)]


def confidence_report(
    conf_logits: ArrayLike,  # (N, K)
    proposed_mask: ArrayLike,  # (N, K) bool
    accepted: ArrayLike,  # (N,) num_accepted or (N, K) accept flags
    temperatures: Sequence[float] | None = None,  # (K,)
    n_bins: int = DEFAULT_ECE_BINS,
) -> dict[str, Any]:
    """ECE / AUROC / Brier of the cumulative survival prediction, per position and pooled.

    Summaries (``ece_mean``, ``auc_mean``, ``brier_mean``, ``pred_mean``,
    ``target_mean``) are count-weighted means over positions with data; AUROC
    skips positions where it is undefined (interop-facts §3). Undefined values
    are NaN.
    """
    per_position = []
    for k, (pred, label) in enumerate(survival_by_position(conf_logits, proposed_mask, accepted, temperatures)):
        per_position.append(
            {
                "position": k,
                "count": int(pred.size),
                "ece": ece(pred, label, n_bins),
                "auroc": auroc(pred, label),
                "brier": brier(pred, label),
                "pred_mean": float(pred.mean()) if pred.size else math.nan,
                "target_mean": float(label.mean()) if label.size else math.nan,
            }
        )

    def weighted_mean(key: str) -> float:
        rows = [r for r in per_position if r["count"] > 0 and not math.isnan(r[key])]
        total = sum(r["count"] for r in rows)
        return sum(r[key] * r["count"] for r in rows) / total if total else math.nan

    return {
        "count": sum(r["count"] for r in per_position),
        "ece_mean": weighted_mean("ece"),
        "auc_mean": weighted_mean("auroc"),
        "brier_mean": weighted_mean("brier"),
        "pred_mean": weighted_mean("pred_mean"),
        "target_mean": weighted_mean("target_mean"),
        "per_position": per_position,
    }
