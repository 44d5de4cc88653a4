"""Confidence-head metrics (pure functions, no model code).

Shapes: N = speculative steps (rows), K = draft positions per block (gamma).
Position k is 0-based here; papers and plots say "draft position k+1".

The metrics judge the confidence head's cumulative prediction
``survival_k = prod_{j<=k} sigmoid(logit_j / T_j)`` against the label "drafts
0..k were all accepted" (paper §3.2.1; docs/interop.md §Evaluation protocol): ``ece``,
``auroc``, ``brier`` and ``confidence_report``. The acceptance counters of the
decoding loop (``AcceptanceStats``: tau, prefix and per-position acceptance)
live beside the loop, in ``dspark.generation.stats``.

Arrays may be numpy arrays, torch tensors or sequences; everything is computed
in float64 numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
    (eq. 7 with STS, paper §3.2.1; docs/conventions.md §Confidence and STS); label_k = drafts 0..k all accepted.
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
    skips positions where it is undefined (docs/interop.md §Evaluation protocol). Undefined values
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
