"""Acceptance statistics of the decoding loop: what each speculative step verified, accepted, committed.

Shapes: N = speculative steps, K = draft positions per block (gamma). Position
k is 0-based here; papers and plots say "draft position k+1".

``AcceptanceStats`` accumulates, per speculative step, how many draft tokens
were verified (``proposal_len``), how many of them were accepted
(``num_accepted``) and how many tokens the step committed
(``acceptance_length`` = accepted + 1 bonus token, or just accepted when an
EOS inside the accepted drafts ended generation). It keeps a joint histogram,
so its memory does not grow with the number of steps. It reports both acceptance
curves: DeepSpec's prefix acceptance ``accept_rate@k`` (docs/interop.md §Evaluation protocol) and
the per-position conditional acceptance of paper §4.3.1 (docs/conventions.md §Acceptance metrics).

The generator and the serving engine fill it; evaluation pools and reports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _int_array(x: Any) -> np.ndarray:
    """A flat int64 numpy copy of a tensor, array or sequence."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.int64).numpy().ravel()
    return np.asarray(x).astype(np.int64).ravel()


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
        proposal_len: Any,  # (N,) int: tensor, array or sequence
        num_accepted: Any,  # (N,) int
        acceptance_length: Any,  # (N,) int
    ) -> None:
        """Record many steps at once (one host transfer for a whole batch)."""
        proposal = _int_array(proposal_len)
        accepted = _int_array(num_accepted)
        length = _int_array(acceptance_length)
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
        (docs/interop.md §Evaluation protocol), pooled over steps. When every step verifies all K drafts
        it is exactly the product of ``conditional_acceptance(j)`` for j <= k.
        NaN if position k was never verified.
        """
        self._check_position(k)
        proposed = self._count(k + 1, 0)
        return self._count(k + 1, k + 1) / proposed if proposed else math.nan

    def conditional_acceptance(self, k: int) -> float:
        """#(num_accepted > k) / #(num_accepted >= k and proposal_len > k).

        P(draft k accepted | drafts < k accepted, draft k verified): the
        per-position conditional acceptance of paper §4.3.1, Fig. 2 (docs/conventions.md §Acceptance metrics).
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
