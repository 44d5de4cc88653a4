"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the last n-gram.

Needs no training and no model. Proposals are deterministic, so their
``draft_probs`` are one-hot; rejection sampling against one-hot drafts stays
lossless (accept with probability target_probs[x], else resample from the
residual).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.drafters.base import DraftBlock, RequestState


def lookup_continuation(tokens: list[int], max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Tokens following the most recent earlier match of the longest suffix n-gram."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):  # most recent match first
            if tokens[start : start + n] == suffix:
                cont = tokens[start + n : start + n + max_tokens]
                if cont:
                    return cont
    return []


@dataclass
class PromptLookupDrafter:
    vocab_size: int
    block_size: int = 7
    max_ngram: int = 3
    min_ngram: int = 1
    target_layer_ids: list[int] | None = None

    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        conts = [
            lookup_continuation(r.tokens, self.max_ngram, self.min_ngram, min(m, self.block_size))
            for r, m in zip(requests, max_tokens)
        ]
        K = max((len(c) for c in conts), default=0)
        tokens = torch.zeros(len(requests), K, dtype=torch.long)
        for r, c in enumerate(conts):
            tokens[r, : len(c)] = torch.tensor(c, dtype=torch.long)
        num = torch.tensor([len(c) for c in conts], dtype=torch.long)
        probs = torch.nn.functional.one_hot(tokens, self.vocab_size).float()  # (R, K, V)
        probs *= (torch.arange(K)[None, :] < num[:, None])[..., None]
        return DraftBlock(tokens=tokens, num_tokens=num, draft_probs=probs)
