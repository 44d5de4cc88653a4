"""The drafter protocol: what the speculative loop needs from any drafter.

Shapes: R = requests in the batch, K = max draft tokens this step (<= block
size), V = vocabulary size, F = concatenated target-feature width
(len(target_layer_ids) * hidden size).

A drafter proposes a block of draft tokens per request together with the full
distributions ``draft_probs`` they were sampled from (the rejection sampler
needs them to stay lossless) and, optionally, per-position confidences.
Drafter-private state (a draft KV cache, projected context) lives in
``RequestState.draft_state`` and is created by the drafter on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from dspark.sampling.processing import SamplingParams


@dataclass
class RequestState:
    """One request as the loop and the drafters see it (token ids only)."""

    request_id: str
    prompt_len: int
    tokens: list[int]  # committed tokens: prompt + generated; tokens[-1] is the anchor (not yet fed to the target)
    sampling: SamplingParams
    generator: torch.Generator
    # target features of tokens[:-1] (every fed, committed position), if the drafter asks for them
    context_features: torch.Tensor | None = None  # (n_fed, F)
    feature_buffer: Any = None  # the room context_features is a view of (dspark.generation.context_features)
    draft_state: Any = None  # the drafter's own per-request state (DSpark: its projected-context cache)
    hybrid_state: Any = None  # HybridDrafter's per-request acceptance statistics (dspark.drafters.hybrid)
    finished: bool = False
    finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def anchor(self) -> int:
        return self.tokens[-1]


@dataclass
class DraftBlock:
    """A proposal for R requests; row r uses its first ``num_tokens[r]`` entries."""

    tokens: torch.Tensor  # (R, K) int64, padding is 0
    num_tokens: torch.Tensor  # (R,) int64, 0 <= num_tokens[r] <= K
    draft_probs: torch.Tensor  # (R, K, V) float32, the distributions the tokens were sampled from
    confidence_logits: torch.Tensor | None = None  # (R, K) raw confidence-head logits (eq. 7), before sigmoid

    @property
    def max_tokens(self) -> int:
        return self.tokens.shape[1]


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes draft tokens for a batch of requests."""

    #: most draft tokens proposed per step (gamma)
    block_size: int
    #: target layers whose hidden states the drafter reads (HF ``hidden_states[l + 1]``), or None
    target_layer_ids: list[int] | None

    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        """Draft up to ``max_tokens[r]`` tokens after ``requests[r].tokens``.

        Tokens are sampled with each request's ``sampling`` params (processed by
        ``logits_to_probs``) and its ``generator``.
        """
        ...


def empty_block(num_requests: int, vocab_size: int) -> DraftBlock:
    """A block that proposes nothing (plain autoregressive decoding)."""
    return DraftBlock(
        tokens=torch.zeros(num_requests, 0, dtype=torch.long),
        num_tokens=torch.zeros(num_requests, dtype=torch.long),
        draft_probs=torch.zeros(num_requests, 0, vocab_size),
    )


@dataclass
class NoDrafter:
    """Proposes nothing: the loop then decodes one target token per step."""

    vocab_size: int
    block_size: int = 0
    target_layer_ids: list[int] | None = field(default=None)

    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        return empty_block(len(requests), self.vocab_size)
