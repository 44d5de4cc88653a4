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
    drafted_steps: int = 0  # steps whose drafter ran for this request (the async scheduler's draft gate reads it)
    drafted_tokens: int = 0  # tokens those steps committed for it, bonus included
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
    # (R, K, V) float32, the distributions the tokens were sampled from; (R, K, W) over ``vocab`` when it is set.
    # Rows of greedy requests may be left 0: their verification compares tokens and never reads them
    draft_probs: torch.Tensor
    confidence_logits: torch.Tensor | None = None  # (R, K) raw confidence-head logits (eq. 7), before sigmoid
    # (W,) int64: the token id of each entry of draft_probs' last axis (a drafter with a draft vocabulary samples
    # among W tokens; its distributions are 0 elsewhere); None = draft_probs covers all V tokens
    vocab: torch.Tensor | None = None

    @property
    def max_tokens(self) -> int:
        return self.tokens.shape[1]

    def spread(self, rows: list[int], num_requests: int) -> DraftBlock:
        """This block of len(rows) requests as a block of ``num_requests``: row i becomes row ``rows[i]``; the other
        rows propose nothing (a step where only some requests drafted)."""
        R, idx = num_requests, torch.tensor(rows, dtype=torch.long, device=self.tokens.device)

        def widen(x: torch.Tensor) -> torch.Tensor:  # (S, ...) -> (R, ...), zeros elsewhere
            out = x.new_zeros((R, *x.shape[1:]))
            out[idx] = x
            return out

        return DraftBlock(widen(self.tokens), widen(self.num_tokens), widen(self.draft_probs),
                          None if self.confidence_logits is None else widen(self.confidence_logits), self.vocab)

    def probs_over_vocabulary(self, rows: list[int], K: int, vocab_size: int) -> torch.Tensor:  # (len(rows), K, V)
        """The distributions of the first K drafts of ``rows`` over all ``vocab_size`` tokens (what rejection
        sampling compares with the target's): scattered from the draft vocabulary only for these rows, so a batch
        of greedy requests, whose verification never reads them, never pays for (R, K, V)."""
        probs = self.draft_probs[rows, :K]  # (S, K, V) or (S, K, W)
        if self.vocab is None:
            return probs
        full = torch.zeros(len(rows), K, vocab_size, dtype=probs.dtype, device=probs.device)
        full[:, :, self.vocab.to(probs.device)] = probs
        return full

    def rows(self, rows: list[int], K: int, vocab_size: int) -> DraftRows:
        """The distributions of the first K drafts of ``rows``, as the rejection sampler reads them (each draft's
        probability, then one row per request over all ``vocab_size`` tokens), without building (len(rows), K, V)."""
        return DraftRows(self, rows, K, vocab_size)


@dataclass
class DraftRows:
    """``Rows`` (``dspark.sampling.rejection``) of some requests of a ``DraftBlock``: row k of request i is the
    distribution its k-th draft was sampled from, over all V tokens (0 outside the draft vocabulary)."""

    block: DraftBlock
    requests: list[int]  # (S,) the block's rows read
    K: int
    vocab_size: int

    def at(self, tokens: torch.Tensor) -> torch.Tensor:  # (S, K) token ids -> (S, K) their draft probabilities
        probs, vocab = self.block.draft_probs, self.block.vocab
        dev = probs.device
        S, K = tokens.shape
        req = torch.tensor(self.requests, dtype=torch.long, device=dev)[:, None].expand(S, K)
        pos = torch.arange(K, device=dev)[None, :].expand(S, K)
        tokens = tokens.to(dev)
        if vocab is None:
            return probs[req, pos, tokens]
        where = torch.full((self.vocab_size,), -1, dtype=torch.long, device=dev)  # (V,) entry of each token in W
        where[vocab.to(dev)] = torch.arange(len(vocab), device=dev)
        entry = where[tokens]  # (S, K), -1 outside the draft vocabulary
        return torch.where(entry >= 0, probs[req, pos, entry.clamp_min(0)], 0.0)

    def rows(self, index: torch.Tensor) -> torch.Tensor:  # (S,) positions in 0..K-1 -> (S, V)
        probs, vocab = self.block.draft_probs, self.block.vocab
        dev = probs.device
        picked = probs[torch.tensor(self.requests, dtype=torch.long, device=dev), index.to(dev)]  # (S, V) or (S, W)
        if vocab is None:
            return picked
        full = torch.zeros(len(self.requests), self.vocab_size, dtype=picked.dtype, device=dev)
        full[:, vocab.to(dev)] = picked
        return full


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
