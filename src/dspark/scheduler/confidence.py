"""From a draft block's confidence logits to verify lengths: one adapter for generate, eval and serve.

Shapes: R = requests in the step, K = most draft tokens proposed this step.

``speculative_step`` hands each draft block to ``ConfidenceAdapter.verify_len``:

1. per-step confidences c_{r,k} = sigmoid(logit_{r,k} / T_k), eq. (7) with the
   STS temperatures T_k (T_k = 1 without an STS file), always in float64;
2. ``policy.choose(confidences, num_candidates)`` (a ``VerifyPolicy``) gives
   ``verify_len`` (R,) int64; a policy that reads no confidences gets None.

So the offline generator, the eval runner and the serving engine schedule the
same drafter with the same confidences and the same verify lengths.

Drafters without a confidence head (prompt lookup, DFlash, draft models).
Decision: they get the constant confidence ``fallback_confidence`` (default
1.0) at every position. A constant does not depend on the drafts, so every
policy stays lossless; with 1.0 ``threshold:T`` verifies everything and
``alg1`` / ``async`` reduce to hardware-only planning (admit drafts while the
SPS table says the extra batch tokens are worth it, which with no table is
verify-all). Pass a smaller constant (e.g. the drafter's measured acceptance
rate) to make the planner trim, or ``fallback_confidence=None`` to refuse such
drafters (``PolicyError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dspark.drafters.base import DraftBlock
from dspark.scheduler.policies import PolicyError, VerifyPolicy
from dspark.scheduler.sts import apply_sts


@dataclass
class ConfidenceAdapter:
    """A verify policy with its confidence calibration: draft block -> verify_len.

    Call ``verify_len`` once per engine step (``AsyncTopKScheduler`` keeps a
    history of steps). ``policy=None`` verifies every proposed draft.
    """

    policy: VerifyPolicy | None = None
    sts_temperatures: Sequence[float] | None = None  # (gamma,) T_k; None = plain sigmoid
    fallback_confidence: float | None = 1.0  # c for drafters without a confidence head; None = refuse them
    name: str = ""  # for logs; default: the policy's class name

    def __post_init__(self) -> None:
        fallback = self.fallback_confidence
        if fallback is not None and not 0.0 <= fallback <= 1.0:
            raise PolicyError(f"fallback confidence must lie in [0, 1], got {fallback}")
        if self.sts_temperatures is not None:
            if not all(t > 0 for t in self.sts_temperatures):
                raise PolicyError(f"STS temperatures must be > 0, got {self.sts_temperatures}")
            self.sts_temperatures = tuple(float(t) for t in self.sts_temperatures)
        self.name = self.name or ("all" if self.policy is None else type(self.policy).__name__)

    @classmethod
    def of(cls, policy: VerifyPolicy | ConfidenceAdapter | None) -> ConfidenceAdapter:
        """``policy`` itself if it is an adapter, else ``policy`` with plain sigmoid confidences."""
        return policy if isinstance(policy, cls) else cls(policy)

    def confidences(self, block: DraftBlock) -> torch.Tensor:  # (R, K) float64 in [0, 1]
        """c_{r,k} = sigmoid(logit_{r,k} / T_k) (eq. 7 + STS), or the constant fallback."""
        R, K = block.tokens.shape
        if block.confidence_logits is None:
            if self.fallback_confidence is None:
                raise PolicyError(
                    f"policy {self.name} needs per-step confidences from a confidence head; this drafter has "
                    "none. Give a fallback confidence or use a fixed verify length"
                )
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

    def verify_len(self, block: DraftBlock) -> torch.Tensor:  # (R,) int64, 0 <= l_r <= num_tokens[r]
        num_candidates = block.num_tokens.to(torch.int64)  # (R,)
        if self.policy is None or block.max_tokens == 0:
            return num_candidates.clone()
        confidences = self.confidences(block) if self.policy.requires_confidences else None
        return self.policy.choose(confidences, num_candidates).to(torch.int64)
