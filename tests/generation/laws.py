"""Exact laws of the first generated tokens of a tiny target, by enumerating every context.

Shapes: V = vocabulary size. Used by the loop's statistical tests: a lossless loop must
reproduce the target's processed distribution (temperature, top-k, top-p), so the law of
the sampled tokens is computed here from the target alone, with no drafter and no loop.
"""

from __future__ import annotations

import torch

from dspark.sampling.processing import SamplingParams, logits_to_probs
from dspark.target.model import TargetModel


def _next_probs(target: TargetModel, contexts: list[list[int]], sampling: SamplingParams) -> torch.Tensor:
    """(C, V) float64 processed target distribution of the token after each context (equal lengths)."""
    ids = torch.tensor(contexts, dtype=torch.long).flatten()
    with torch.inference_mode():
        logits = target.forward(ids, [len(contexts[0])] * len(contexts), None, logits_for="last").logits
    s = sampling
    return logits_to_probs(logits, s.temperature, s.top_k, s.top_p).double()


def drafted_pair_law(target: TargetModel, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """Exact P(x2, x3) of the 2nd and 3rd generated tokens, flattened to (V*V,) as x2 * V + x3.

    The first token comes from prefill; tokens 2 and 3 are the ones that go through drafting
    and verification when ``max_new_tokens >= 3``.
    """
    V = target.vocab_size
    p1 = _next_probs(target, [prompt], sampling)[0]  # (V,)
    p2 = _next_probs(target, [prompt + [a] for a in range(V)], sampling)  # (V, V): [x1, x2]
    p3 = _next_probs(target, [prompt + [a, b] for a in range(V) for b in range(V)], sampling).view(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # (V, V, V): [x1, x2, x3]
    return joint.sum(0).flatten()


def pair_samples(output_ids: list[list[int]], V: int) -> torch.Tensor:
    """(n,) outcome x2 * V + x3 of each output (every output must hold at least three tokens)."""
    return torch.tensor([ids[1] * V + ids[2] for ids in output_ids], dtype=torch.long)
