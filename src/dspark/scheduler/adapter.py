"""Verify-length policies by name, adapted to ``speculative_step``'s policy hook.

Shapes: R = requests in the step, K = most draft tokens proposed this step.

``speculative_step`` asks ``policy(block, requests) -> verify_len (R,)``; the
scheduler policies (``dspark.scheduler.policies``) answer
``choose(confidences (R, K) | None, num_candidates (R,))``. The adapter in
between turns the drafter's raw confidence-head logits into calibrated
per-step confidences c_{r,k} = sigmoid(logit_{r,k} / T_k) (eq. 7 with the
STS temperatures T_k; plain sigmoid without an STS file) and calls the policy.

Policy names (``--policy``):

==============  ===========================================================
``all``         verify every proposed draft (SGLang's static mode)
``fixed:N``     verify at most N drafts per request; ``fixed:1`` is the
                MTP-1-like baseline, ``fixed:0`` plain decoding
``threshold:T`` stop at the first per-step confidence below T (DeepSpec)
``alg1``        Algorithm 1, greedy prefix scheduler on the SPS table
``async``       §5.2 lagged-capacity top-K scheduler on the SPS table
==============  ===========================================================

Drafters without a confidence head (prompt lookup, DFlash, draft models).
Decision: they get the constant confidence ``fallback_confidence`` (default
1.0) at every position. A constant does not depend on the drafts, so every
policy stays lossless; with 1.0 ``threshold:T`` verifies everything and
``alg1`` / ``async`` reduce to hardware-only planning (admit drafts while the
SPS table says the extra batch tokens are worth it, which with no table is
verify-all). Pass a smaller constant (e.g. the drafter's measured acceptance
rate) to make the planner trim, or use ``fixed:N`` / ``all``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.errors import DSparkError
from dspark.evaluation.calibration import apply_sts
from dspark.scheduler.policies import (
    AsyncTopKScheduler,
    FixedLength,
    GreedyPrefixScheduler,
    StaticThreshold,
    VerifyPolicy,
)
from dspark.scheduler.sps import SPSTable

POLICY_HELP = "all | fixed:N | threshold:T | alg1 | async"


class PolicyError(DSparkError):
    """A ``--policy`` value that cannot be parsed or used."""


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy name."""

    kind: str  # "all" | "fixed" | "threshold" | "alg1" | "async"
    value: float | None = None  # N for fixed, T for threshold

    @property
    def needs_sps_table(self) -> bool:
        return self.kind in ("alg1", "async")

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.value)}"
        if self.kind == "threshold":
            return f"threshold:{self.value:g}"
        return self.kind


def parse_policy(name: str) -> PolicySpec:
    """``"fixed:1"`` -> PolicySpec("fixed", 1), etc.; raises PolicyError with the accepted forms."""
    text = name.strip().lower()
    kind, _, arg = text.partition(":")
    if kind in ("all", "alg1", "async") and not arg:
        return PolicySpec(kind)
    if kind == "fixed" and arg:
        try:
            n = int(arg)
        except ValueError:
            n = -1
        if n < 0:
            raise PolicyError(f"policy {name!r}: fixed:N needs an integer N >= 0, e.g. fixed:1")
        return PolicySpec("fixed", n)
    if kind == "threshold" and arg:
        try:
            t = float(arg)
        except ValueError:
            t = math.nan
        if not 0.0 <= t <= 1.0:
            raise PolicyError(f"policy {name!r}: threshold:T needs 0 <= T <= 1, e.g. threshold:0.5")
        return PolicySpec("threshold", t)
    raise PolicyError(f"unknown policy {name!r}; use one of {POLICY_HELP}")


def build_scheduler(spec: PolicySpec, sps_table: SPSTable | None = None) -> VerifyPolicy | None:
    """The scheduler policy for ``spec``; None for ``all`` (speculative_step verifies everything).

    ``alg1`` / ``async`` without a table get ``SPSTable.flat()``, which admits every
    draft with positive survival (verify-all); the CLI profiles a table instead.
    """
    if spec.kind == "all":
        return None
    if spec.kind == "fixed":
        return FixedLength(int(spec.value))
    if spec.kind == "threshold":
        return StaticThreshold(float(spec.value))
    table = sps_table if sps_table is not None else SPSTable.flat()
    if spec.kind == "alg1":
        return GreedyPrefixScheduler(table)
    return AsyncTopKScheduler(table)


class SchedulerAdapter:
    """``speculative_step``'s policy: block -> calibrated confidences -> ``scheduler.choose``.

    Call it once per engine step (``AsyncTopKScheduler`` keeps a history of
    steps). ``scheduler=None`` verifies every proposed draft.
    """

    def __init__(
        self,
        scheduler: VerifyPolicy | None,
        sts_temperatures: list[float] | None = None,  # (gamma,) T_k; None = raw sigmoid
        fallback_confidence: float = 1.0,  # for drafters without a confidence head
        name: str = "",
    ) -> None:
        if not 0.0 <= fallback_confidence <= 1.0:
            raise PolicyError(f"fallback confidence must lie in [0, 1], got {fallback_confidence}")
        if sts_temperatures is not None and not all(t > 0 for t in sts_temperatures):
            raise PolicyError(f"STS temperatures must be > 0, got {sts_temperatures}")
        self.scheduler = scheduler
        self.sts_temperatures = sts_temperatures
        self.fallback_confidence = fallback_confidence
        self.name = name or type(scheduler).__name__

    def confidences(self, block: DraftBlock) -> torch.Tensor:  # (R, K) in [0, 1]
        """c_{r,k} = sigmoid(logit_{r,k} / T_k) (eq. 7 + STS), or the constant fallback."""
        R, K = block.tokens.shape
        if block.confidence_logits is None:
            return torch.full((R, K), self.fallback_confidence, dtype=torch.float64, device=block.tokens.device)
        logits = block.confidence_logits[:, :K].double()  # (R, K)
        if self.sts_temperatures is None:
            return torch.sigmoid(logits)
        if K > len(self.sts_temperatures):
            raise PolicyError(
                f"the drafter proposed {K} tokens but the STS file has {len(self.sts_temperatures)} "
                "temperatures; refit STS for this drafter's block size"
            )
        return apply_sts(logits, self.sts_temperatures[:K])

    def __call__(self, block: DraftBlock, requests: list[RequestState]) -> torch.Tensor:  # (R,) int64
        num_candidates = block.num_tokens.to(torch.int64)  # (R,)
        if self.scheduler is None or block.max_tokens == 0:
            return num_candidates.clone()
        conf = self.confidences(block) if self.scheduler.requires_confidences else None
        return self.scheduler.choose(conf, num_candidates).to(torch.int64)


def make_policy(
    name: str,
    sps_table: SPSTable | None = None,
    sts_temperatures: list[float] | None = None,
    fallback_confidence: float = 1.0,
) -> SchedulerAdapter:
    """One call from a ``--policy`` string to the adapter the engine uses."""
    spec = parse_policy(name)
    return SchedulerAdapter(build_scheduler(spec, sps_table), sts_temperatures, fallback_confidence, str(spec))
