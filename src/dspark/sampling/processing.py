"""Turn logits into the sampling distribution, identically for target and draft.

Shapes: ``(..., V)`` — any leading dims, V = vocabulary size.

Temperature 0 (or below ``GREEDY_EPS``) means greedy: the distribution is the
one-hot vector of the argmax, so rejection sampling reduces to exact match.
top-k and top-p are applied after temperature, to target and draft alike
(docs/conventions.md §Verification), so the verifier's target distribution is the processed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings. ``seed`` makes a request reproducible."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def make_generator(self) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed() % (2**63))
        return gen


def logits_to_probs(
    logits: torch.Tensor,  # (..., V)
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # (..., V) float32, rows sum to 1
    """Processed sampling distribution for one request's logits."""
    logits = logits.float()
    if temperature < GREEDY_EPS:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        drop_sorted = (cum - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(
    probs: torch.Tensor,  # (V,) or (N, V)
    generator: torch.Generator | None,
) -> torch.Tensor:  # () or (N,) int64
    """Inverse-CDF sampling with one uniform per row from ``generator``.

    Uses one uniform per row (not torch.multinomial) so that the random stream
    a request consumes does not depend on the vocabulary layout or batch.
    """
    squeeze = probs.dim() == 1
    rows = probs.reshape(-1, probs.shape[-1]).float()
    cdf = rows.cumsum(-1)  # (N, V)
    # uniforms come from the generator's device (a request's generator is on the CPU), then join the probs
    u = torch.rand(rows.shape[0], 1, generator=generator, device=generator.device if generator is not None else None)
    u = u.to(rows.device) * cdf[:, -1:]  # (N, 1)
    idx = torch.searchsorted(cdf, u, right=True).clamp_max(rows.shape[-1] - 1).squeeze(-1)
    # searchsorted may land on a zero-probability slot after float round-off: step back
    bad = rows.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, rows.argmax(-1), idx)
    return idx[0] if squeeze else idx
