"""Hybrid drafting: the context's own continuation when it repeats itself, a trained drafter otherwise.

Shapes: R = requests, K = drafts proposed this step, V = vocabulary.

Prompt lookup wins where an answer copies its context (code edits, a restated
equation, a list that repeats a pattern); a trained drafter (DSpark, DFlash,
Eagle3) wins everywhere else. Per request and per step this drafter asks
``lookup_continuation`` for the tokens that followed the latest earlier
occurrence of the context's last n-gram:

* a long match (n >= ``min_ngram``) is drafted (one-hot draft distributions,
  as ``PromptLookupDrafter``);
* a short match (1 <= n < ``min_ngram``, ``adaptive``) is drafted when it is
  expected to pay more than the trained drafter: each request keeps running
  means (EMA, ``alpha``) of the drafts accepted per step from short lookups and
  from the trained drafter, read off the tokens committed after each proposal,
  and takes the lookup when (1 + E_lookup)(1 + ``draft_cost``) >= 1 + E_model,
  i.e. when it commits at least as many tokens per unit of time; ``draft_cost``
  is the trained drafter's time per step relative to a target step, which a
  lookup does not pay (about 0.2 for DSpark on SmolLM2 on a CPU,
  docs/reports/performance.md). Both means start at 1, so each source is tried;
* otherwise the trained drafter drafts, all such requests in one batched call.

Lossless: the choice is a function of the committed tokens and of this
request's earlier proposals only, made before any draft of this step is
sampled, so each row's proposal is sampled from exactly the distribution
reported in ``draft_probs`` (one-hot for a lookup row, the trained drafter's
own for the rest) and the rejection sampler's guarantee holds row by row,
conditionally on the history. The trained drafter is simply not called for
lookup rows in that step; DSpark/DFlash bring their context cache up to date
the next time they see the request.

Confidences: the trained drafter's confidence logits where it drafted; a
lookup row reports ``lookup_confidence_logit`` at each of its drafts (a verify
policy that reads confidences then treats them as likely accepted), and zeros
when the trained drafter has no confidence head (then no row has any).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.drafters.base import DraftBlock, Drafter, RequestState
from dspark.drafters.prompt_lookup import lookup_continuation


@dataclass
class HybridTrack:
    """One request's running acceptance per drafting source (``RequestState.hybrid_state``)."""

    short_lookup: float = 1.0  # EMA of drafts accepted per step when a short match was drafted
    model: float = 1.0  # the same for the trained drafter
    last: tuple[str, int, list[int]] | None = None  # (source, len(tokens) when proposed, the proposed tokens)

    def observe(self, tokens: list[int], alpha: float) -> None:
        """Fold in the outcome of the last proposal: its drafts that the committed tokens start with."""
        if self.last is None:
            return
        source, start, proposed = self.last
        committed = tokens[start : start + len(proposed)]
        accepted = next((i for i, (a, b) in enumerate(zip(proposed, committed)) if a != b), len(committed))
        if source == "short":
            self.short_lookup += alpha * (accepted - self.short_lookup)
        elif source == "model":
            self.model += alpha * (accepted - self.model)
        self.last = None


@dataclass
class HybridDrafter:
    model_drafter: Drafter  # the trained drafter (DSpark, DFlash, Eagle3, a draft LM)
    vocab_size: int
    min_ngram: int = 3  # shortest suffix n-gram whose earlier occurrence is drafted without asking
    max_ngram: int | None = None  # longest n-gram tried first (None: max(min_ngram, 4))
    lookup_confidence_logit: float = 4.0  # sigmoid ~ 0.98
    adaptive: bool = True  # shorter matches (n < min_ngram) when they pay more than the trained drafter
    draft_cost: float = 0.2  # the trained drafter's time per step over a target step's
    alpha: float = 0.25  # EMA weight of the newest step

    def __post_init__(self) -> None:
        if self.max_ngram is None:
            self.max_ngram = max(self.min_ngram, 4)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")
        if self.draft_cost < 0 or not 0 < self.alpha <= 1:
            raise ValueError(f"need draft_cost >= 0 and 0 < alpha <= 1, got {self.draft_cost} and {self.alpha}")
        self.block_size = self.model_drafter.block_size
        self.target_layer_ids = self.model_drafter.target_layer_ids
        self.has_confidence = bool(getattr(self.model_drafter, "has_confidence", False))
        self.lookup_steps = self.model_steps = 0  # per-request drafting decisions, for reports
        self.short_lookup_steps = 0  # of lookup_steps, those on a match shorter than min_ngram

    def lookup(self, req: RequestState, max_tokens: int) -> list[int]:
        """The context's continuation this drafter would propose for ``req`` ([] = ask the trained drafter)."""
        return lookup_continuation(req.tokens, self.max_ngram, self.min_ngram, min(max_tokens, self.block_size))

    def _choose(self, req: RequestState, max_tokens: int) -> tuple[str, list[int]]:
        """("long" | "short", continuation) to draft by lookup, or ("model", []) for the trained drafter."""
        track = req.hybrid_state if isinstance(req.hybrid_state, HybridTrack) else HybridTrack()
        req.hybrid_state = track
        track.observe(req.tokens, self.alpha)
        cont = self.lookup(req, max_tokens)
        if cont:
            return "long", cont
        if self.adaptive and self.min_ngram > 1:
            short = lookup_continuation(req.tokens, self.min_ngram - 1, 1, min(max_tokens, self.block_size))
            if short and (1 + track.short_lookup) * (1 + self.draft_cost) >= 1 + track.model:
                return "short", short
        return "model", []

    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        want = [max(0, min(int(m), self.block_size)) for m in max_tokens]
        choices = [self._choose(r, m) if m > 0 else (None, []) for r, m in zip(requests, want)]
        conts = [c for _, c in choices]
        rest = [i for i, (source, _) in enumerate(choices) if source == "model"]
        self.lookup_steps += sum(1 for c in conts if c)
        self.short_lookup_steps += sum(1 for source, _ in choices if source == "short")
        self.model_steps += len(rest)
        sub = self.model_drafter.propose([requests[i] for i in rest], [want[i] for i in rest]) if rest else None

        R = len(requests)
        K = max([len(c) for c in conts] + ([sub.max_tokens] if sub is not None else []) + [0])
        dev = sub.tokens.device if sub is not None else torch.device("cpu")
        tokens = torch.zeros(R, K, dtype=torch.long, device=dev)
        num_tokens = torch.zeros(R, dtype=torch.long, device=dev)
        draft_probs = torch.zeros(R, K, self.vocab_size, device=dev)
        conf = torch.zeros(R, K, device=dev) if self.has_confidence else None
        for r, cont in enumerate(conts):
            if cont:
                n = len(cont)
                tokens[r, :n] = torch.tensor(cont, dtype=torch.long, device=dev)
                num_tokens[r] = n
                draft_probs[r, torch.arange(n, device=dev), tokens[r, :n]] = 1.0  # one-hot: the exact proposal
                if conf is not None:
                    conf[r, :n] = self.lookup_confidence_logit
        if sub is not None:
            k = sub.max_tokens
            rows = torch.tensor(rest, dtype=torch.long, device=dev)
            tokens[rows, :k] = sub.tokens
            num_tokens[rows] = sub.num_tokens
            # over V for the sampled requests only: greedy verification compares tokens (DraftBlock.draft_probs)
            sampled = [j for j, i in enumerate(rest) if not requests[i].sampling.greedy]
            if sampled:
                draft_probs[rows[sampled], :k] = sub.probs_over_vocabulary(sampled, k, self.vocab_size).to(
                    draft_probs.dtype)
            if conf is not None and sub.confidence_logits is not None:
                conf[rows, :k] = sub.confidence_logits.to(conf.dtype)
        model_rows = {i: j for j, i in enumerate(rest)}
        for r, ((source, cont), req) in enumerate(zip(choices, requests)):
            if source is not None:  # what the next step's observe() compares the committed tokens with
                proposed = cont if cont else sub.tokens[model_rows[r], : int(sub.num_tokens[model_rows[r]])].tolist()
                req.hybrid_state.last = (source, len(req.tokens), proposed)
        return DraftBlock(tokens, num_tokens, draft_probs, conf)
