"""Verify policies that are biased on purpose: negative controls for the losslessness tests."""

from __future__ import annotations

import torch

from dspark.scheduler.policies import AsyncTopKScheduler
from dspark.scheduler.sps import SPSTable


class CurrentStepCapacity:
    """BIASED: the asynchronous top-K policy with lag 0 (§5.2 without the lag).

    It records the current step's survivals first and then sizes the batch from them,
    so the capacity K reads a_{r,j+1}, which depends on draft x_{r,j}: with one request
    per step this is the retrospective global search of Appendix A. Built from the real
    ``AsyncTopKScheduler`` with lag 1, called twice per step.
    """

    requires_confidences = True

    def __init__(self, sps_table: SPSTable) -> None:
        self.inner = AsyncTopKScheduler(sps_table, lag=1)

    def choose(self, confidences: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:  # (R,)
        self.inner.choose(confidences, num_candidates)  # records this step's survivals (history of length 1)
        return self.inner.choose(confidences, num_candidates)  # capacity from this very step
