"""The STS file: per-position temperatures of sequential temperature scaling (paper §3.2.1).

Shapes: K = draft positions per block (gamma).

The confidence head gives a raw logit per draft position; the calibrated
per-step confidence is c_k = sigmoid(logit_k / T_k) (eq. 7 with the STS
temperature T_k) and the survival of draft k is a_k = prod_{i<=k} c_i.
Fitting the T_k is evaluation's job (``dspark.evaluation.calibration.fit_sts``);
the scheduler only reads the file and applies the temperatures.

File format, as SGLang reads it (``--speculative-dspark-confidence-sts-path``,
docs/interop.md §STS file): ``{"temperatures": [K floats > 0], "dataset": str,
"num_samples": int, "ece_before": [K floats], "ece_after": [K floats]}``
(per-position ECEs, as SGLang's ``DSparkStsCalibration`` types them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dspark.errors import BadFileError


@dataclass
class STSResult:
    temperatures: list[float]  # (K,) T_k > 0
    ece_before: list[float]  # (K,) ECE of the survival at T = 1
    ece_after: list[float]  # (K,) ECE of the survival with the fitted temperatures
    num_samples: int  # N rows (speculative steps) used


def apply_sts(
    conf_logits: torch.Tensor | np.ndarray,  # (..., K)
    temperatures: Sequence[float],  # (K,)
) -> torch.Tensor | np.ndarray:  # (..., K) calibrated per-step confidences c_k
    """c_k = sigmoid(logit_k / T_k); the survival is their cumulative product over k.

    Tensors keep their dtype and device; arrays are computed in float64.
    """
    if conf_logits.shape[-1] != len(temperatures):
        raise ValueError(f"conf_logits has {conf_logits.shape[-1]} positions but {len(temperatures)} temperatures")
    if not isinstance(conf_logits, torch.Tensor):
        return apply_sts(torch.from_numpy(np.asarray(conf_logits, dtype=np.float64)), temperatures).numpy()
    temps = torch.tensor(list(temperatures), dtype=conf_logits.dtype, device=conf_logits.device)
    return torch.sigmoid(conf_logits / temps)


def save_sts_json(path: str | Path, result: STSResult, dataset: str) -> None:
    """Write the SGLang STS file (``--speculative-dspark-confidence-sts-path``)."""
    payload = {
        "temperatures": [float(t) for t in result.temperatures],
        "dataset": dataset,
        "num_samples": int(result.num_samples),
        "ece_before": [float(e) for e in result.ece_before],
        "ece_after": [float(e) for e in result.ece_after],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def load_sts_json(path: str | Path, block_size: int) -> list[float]:
    """Read and validate an STS file; returns the K = ``block_size`` temperatures.

    Raises ``BadFileError`` (one line naming the file) for a missing, unreadable or malformed file.
    """
    path = Path(path)

    def bad(what: str) -> BadFileError:
        return BadFileError(f"STS file {path} {what}")

    if not path.is_file():
        raise bad("does not exist; fit one first (`dspark calibrate`)")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        raise bad(f"is not valid JSON ({err})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("temperatures"), list):
        raise bad("must be a JSON object with a 'temperatures' list")
    temps = payload["temperatures"]
    if len(temps) != block_size:
        raise bad(f"has {len(temps)} temperatures but the drafter's block size is {block_size}; "
                  "refit STS for this drafter")
    ok = all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in temps)
    if not ok:
        raise bad(f"has temperatures that are not all finite and > 0: {temps}")
    return [float(t) for t in temps]
