"""Sequential temperature scaling (STS) of the confidence head (paper §3.2.1; docs/conventions.md §Confidence and STS).

Shapes: N = speculative steps (rows), K = draft positions per block (gamma).

The confidence head gives a raw logit per draft position; the calibrated
per-step confidence is c_k = sigmoid(logit_k / T_k) and the survival of draft
k is a_k = prod_{i<=k} c_i. STS picks T_1, T_2, ... in order, each from a grid,
to minimise the ECE of a_k over the rows where draft k was verified, keeping
the earlier temperatures fixed. Dividing by T_k > 0 is monotone, so STS never
changes the order of confidences at a position.

The fitted temperatures go to the STS file, which the scheduler reads
(``dspark.scheduler.sts``: ``STSResult``, ``save_sts_json``, ``load_sts_json``,
``apply_sts``).

Files, in the format SGLang reads (docs/interop.md §STS file):

* Confidence shards (``torch.save`` of plain tensors): ``logits`` float32 (N, K)
  and ``prefix_mask`` float32 (N, K) = 1 where drafts 0..k were all accepted
  (SGLang's key and meaning, so ``sglang.benchmark.dspark_sts_fit`` reads our
  shards), plus ``proposed_mask`` bool (N, K) and ``num_accepted`` int64 (N,).
  Shards without ``proposed_mask`` (SGLang's own) count every position as
  verified, which is what SGLang's static verify mode does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dspark.evaluation.metrics import (
    DEFAULT_ECE_BINS,
    EPS_PROB,
    ArrayLike,
    ece,
    prefix_labels,
    sigmoid,
    to_numpy,
)
from dspark.scheduler.sts import STSResult


def default_temperature_grid(num: int = 41, low: float = 0.1, high: float = 10.0) -> list[float]:
    """``num`` log-spaced temperatures in [low, high] (SGLang: 41 in [0.1, 10])."""
    if not 0 < low <= high or num < 1:
        raise ValueError(f"need num >= 1 and 0 < low <= high, got num={num}, low={low}, high={high}")
    return np.logspace(math.log10(low), math.log10(high), num).tolist()


def fit_sts(
    conf_logits: ArrayLike,  # (N, K) raw confidence-head logits
    proposed_mask: ArrayLike,  # (N, K) bool: draft k was verified
    num_accepted: ArrayLike,  # (N,) accepted drafts, or (N, K) accept flags
    grid: Sequence[float] | None = None,  # candidate temperatures; default_temperature_grid()
    n_bins: int = DEFAULT_ECE_BINS,  # SGLang's fitter uses 15, DeepSpec's evaluator 20
) -> STSResult:
    """Greedy sequential grid search of one temperature per position (docs/conventions.md §Confidence and STS).

    On equal ECE the first grid value wins (same rule as SGLang's fitter).
    """
    logits = to_numpy(conf_logits)
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise ValueError(f"conf_logits must be a non-empty (N, K) array, got shape {logits.shape}")
    n, k_max = logits.shape
    mask = to_numpy(proposed_mask, bool)
    if mask.shape != (n, k_max):
        raise ValueError(f"proposed_mask must have shape {(n, k_max)}, got {mask.shape}")
    labels = prefix_labels(num_accepted, k_max).astype(np.float64)  # (N, K)
    if labels.shape[0] != n:
        raise ValueError(f"num_accepted has {labels.shape[0]} rows, conf_logits has {n}")
    if (labels.astype(bool) & ~mask).any():
        raise ValueError("a draft is marked accepted at a position that was not proposed; check proposed_mask")
    grid_np = to_numpy(default_temperature_grid() if grid is None else grid).ravel()
    if grid_np.size == 0 or not (grid_np > 0).all():
        raise ValueError(f"the temperature grid must be non-empty and positive, got {grid}")

    def position_ece(survival: np.ndarray, k: int) -> float:  # survival: (N,)
        rows = mask[:, k]
        return ece(np.clip(survival[rows], EPS_PROB, 1.0 - EPS_PROB), labels[rows, k], n_bins)

    temperatures, ece_before, ece_after = [], [], []
    survival_raw = np.ones(n)  # (N,) prod of sigmoid(logit) at T = 1
    survival_fit = np.ones(n)  # (N,) prod with the temperatures fitted so far
    for k in range(k_max):
        if not mask[:, k].any():
            raise ValueError(
                f"draft position {k} was never verified in the calibration data; collect data with "
                "every draft verified (static verification, no confidence threshold)"
            )
        survival_raw = survival_raw * sigmoid(logits[:, k])
        ece_before.append(position_ece(survival_raw, k))
        errors = [position_ece(survival_fit * sigmoid(logits[:, k] / t), k) for t in grid_np]
        best_t = float(grid_np[int(np.argmin(errors))])
        temperatures.append(best_t)
        ece_after.append(min(errors))
        survival_fit = survival_fit * sigmoid(logits[:, k] / best_t)
    return STSResult(temperatures=temperatures, ece_before=ece_before, ece_after=ece_after, num_samples=n)


def position_bins(
    conf_logits: torch.Tensor,  # (N, K) raw confidence logits
    proposed_mask: torch.Tensor,  # (N, K) bool: draft k was verified
    num_accepted: torch.Tensor,  # (N,)
    temperatures: Sequence[float] | None = None,  # (K,) STS; None = plain sigmoid
    n_bins: int = 20,
) -> list[list[dict[str, float]]]:
    """Per draft position k, the per-step confidence c_k = sigmoid(logit_k / T_k) (eq. 7 + STS) binned
    over the steps that reached k (draft k verified, drafts < k accepted): mean c, steps and accepted
    drafts per non-empty equal-width bin. What ``dspark simulate`` draws confidences and acceptance from."""
    K = conf_logits.shape[1]
    temps = torch.ones(K) if temperatures is None else torch.tensor(list(temperatures), dtype=torch.float32)
    conf = torch.sigmoid(conf_logits.float() / temps).double()  # (N, K)
    out = []
    for k in range(K):
        reached = proposed_mask[:, k] & (num_accepted >= k)  # (N,)
        c = conf[reached, k]
        label = (num_accepted[reached] > k).double()
        idx = (c * n_bins).long().clamp(0, n_bins - 1)
        count = torch.bincount(idx, minlength=n_bins)
        c_sum = torch.bincount(idx, c, minlength=n_bins)
        acc = torch.bincount(idx, label, minlength=n_bins)
        out.append([{"c": round(float(c_sum[b] / count[b]), 6), "count": int(count[b]), "accepted": int(acc[b])}
                    for b in range(n_bins) if count[b] > 0])
    return out


# --------------------------------------------------------------------------- shards


@dataclass
class ConfidenceData:
    logits: torch.Tensor  # (N, K) float32 raw confidence logits
    proposed_mask: torch.Tensor  # (N, K) bool
    num_accepted: torch.Tensor  # (N,) int64


def save_confidence_shard(
    path: str | Path,
    logits: torch.Tensor,  # (N, K)
    proposed_mask: torch.Tensor,  # (N, K) bool
    num_accepted: torch.Tensor,  # (N,)
) -> None:
    """Write one collector shard (see the module docstring for the keys)."""
    logits = torch.as_tensor(logits).detach().to("cpu", torch.float32)
    proposed_mask = torch.as_tensor(proposed_mask).detach().to("cpu", torch.bool)
    num_accepted = torch.as_tensor(num_accepted).detach().to("cpu", torch.int64)
    if logits.ndim != 2 or proposed_mask.shape != logits.shape or num_accepted.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits (N, K), proposed_mask (N, K), num_accepted (N,); got {tuple(logits.shape)}, "
            f"{tuple(proposed_mask.shape)}, {tuple(num_accepted.shape)}"
        )
    positions = torch.arange(logits.shape[1])
    prefix_mask = positions[None, :] < num_accepted[:, None]  # (N, K)
    if (prefix_mask & ~proposed_mask).any():
        raise ValueError("num_accepted exceeds the verified drafts in some row; check proposed_mask")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "logits": logits,
            "prefix_mask": prefix_mask.float(),
            "proposed_mask": proposed_mask,
            "num_accepted": num_accepted,
        },
        path,
    )


def load_confidence_shards(paths: Sequence[str | Path]) -> ConfidenceData:
    """Concatenate shards written by ``save_confidence_shard`` or SGLang's collector."""
    if not paths:
        raise ValueError("no confidence shards given; collect some first")
    logits, proposed, accepted = [], [], []
    for path in paths:
        shard = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(shard, dict) or "logits" not in shard:
            raise ValueError(f"{path} is not a confidence shard (needs a 'logits' tensor)")
        shard_logits = shard["logits"].float()  # (n, K)
        if logits and shard_logits.shape[1] != logits[0].shape[1]:
            raise ValueError(f"{path} has K={shard_logits.shape[1]}, earlier shards K={logits[0].shape[1]}")
        if "num_accepted" in shard:
            shard_accepted = shard["num_accepted"].long()
        elif "prefix_mask" in shard:  # SGLang: 1 where drafts 0..k were all accepted
            shard_accepted = shard["prefix_mask"].bool().long().sum(dim=1)
        else:
            raise ValueError(f"{path} has neither 'num_accepted' nor 'prefix_mask'")
        shard_proposed = shard.get("proposed_mask")
        if shard_proposed is None:
            shard_proposed = torch.ones_like(shard_logits, dtype=torch.bool)
        logits.append(shard_logits)
        proposed.append(shard_proposed.bool())
        accepted.append(shard_accepted)
    return ConfidenceData(torch.cat(logits), torch.cat(proposed), torch.cat(accepted))
