"""Hybrid drafting: the context's own continuation when it repeats itself, a trained drafter otherwise.

Shapes: R = requests, K = drafts proposed this step, V = vocabulary.

Prompt lookup wins where an answer copies its context (code edits, a restated
equation, a list that repeats a pattern); a trained drafter (DSpark, DFlash,
Eagle3) wins everywhere else. Per request and per step this drafter asks
``lookup_continuation`` for the tokens that followed the latest earlier
occurrence of the context's last n-gram, n >= ``min_ngram``. Where one exists
the request drafts it (one-hot draft distributions, as ``PromptLookupDrafter``);
the other requests go to the trained drafter in one batched call.

Lossless: the choice between the two is a function of the committed tokens
only, made before any draft is sampled, so each row's proposal is sampled from
exactly the distribution reported in ``draft_probs`` (one-hot for a lookup
row, the trained drafter's own for the rest) and the rejection sampler's
guarantee holds row by row. The trained drafter is simply not called for
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
class HybridDrafter:
    model_drafter: Drafter  # the trained drafter (DSpark, DFlash, Eagle3, a draft LM)
    vocab_size: int
    min_ngram: int = 3  # shortest suffix n-gram whose earlier occurrence is trusted
    max_ngram: int | None = None  # longest n-gram tried first (None: max(min_ngram, 4))
    lookup_confidence_logit: float = 4.0  # sigmoid ~ 0.98

    def __post_init__(self) -> None:
        if self.max_ngram is None:
            self.max_ngram = max(self.min_ngram, 4)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")
        self.block_size = self.model_drafter.block_size
        self.target_layer_ids = self.model_drafter.target_layer_ids
        self.has_confidence = bool(getattr(self.model_drafter, "has_confidence", False))
        self.lookup_steps = self.model_steps = 0  # per-request drafting decisions, for reports

    def lookup(self, req: RequestState, max_tokens: int) -> list[int]:
        """The context's continuation this drafter would propose for ``req`` ([] = ask the trained drafter)."""
        return lookup_continuation(req.tokens, self.max_ngram, self.min_ngram, min(max_tokens, self.block_size))

    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        want = [max(0, min(int(m), self.block_size)) for m in max_tokens]
        conts = [self.lookup(r, m) if m > 0 else [] for r, m in zip(requests, want)]
        rest = [i for i, c in enumerate(conts) if not c and want[i] > 0]
        self.lookup_steps += sum(1 for c in conts if c)
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
            draft_probs[rows, :k] = sub.draft_probs.to(draft_probs.dtype)
            if conf is not None and sub.confidence_logits is not None:
                conf[rows, :k] = sub.confidence_logits.to(conf.dtype)
        return DraftBlock(tokens, num_tokens, draft_probs, conf)
