"""Verify-length policies by name: ``--policy`` strings -> ``ConfidenceAdapter``.

``make_policy`` builds the policy (``dspark.scheduler.policies``) that a name
stands for and wraps it in the one confidence adapter
(``dspark.scheduler.confidence.ConfidenceAdapter``: confidence logits + STS
temperatures -> calibrated confidences -> verify lengths) that the serving
engine, the generator and the eval runner all use.

Policy names (``--policy``):

==============  ===========================================================
``all``         verify every proposed draft (SGLang's static mode)
``fixed:N``     verify at most N drafts per request; ``fixed:1`` is the
                MTP-1-like baseline, ``fixed:0`` plain decoding
``threshold:T`` stop at the first per-step confidence below T (DeepSpec)
``alg1``        Algorithm 1, greedy prefix scheduler on the cost table
``async``       §5.2 lagged-capacity top-K scheduler on the cost table
==============  ===========================================================

The cost table is an ``SPSTable`` (the target's verify pass) or a ``StepCostModel`` (the whole
engine step: drafting, verification, host work; ``dspark.scheduler.step_cost``).

Drafters without a confidence head get the constant ``fallback_confidence``
(see ``dspark.scheduler.confidence``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import (
    AsyncTopKScheduler,
    FixedLength,
    GreedyPrefixScheduler,
    PolicyError,
    StaticThreshold,
    VerifyPolicy,
)
from dspark.scheduler.sps import SPSTable
from dspark.scheduler.step_cost import StepCostModel

POLICY_HELP = "all | fixed:N | threshold:T | alg1 | async"


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


def build_scheduler(spec: PolicySpec, sps_table: SPSTable | StepCostModel | None = None) -> VerifyPolicy | None:
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


def make_policy(
    name: str,
    sps_table: SPSTable | StepCostModel | None = None,
    sts_temperatures: list[float] | None = None,
    fallback_confidence: float = 1.0,
) -> ConfidenceAdapter:
    """One call from a ``--policy`` string to the adapter the engine uses."""
    spec = parse_policy(name)
    return ConfidenceAdapter(build_scheduler(spec, sps_table), sts_temperatures, fallback_confidence, str(spec))
