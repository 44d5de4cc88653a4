"""Drafting one position of a batch of requests: greedy rows by argmax, sampled rows from their processed
distributions, in a few tensor operations (the autoregressive drafters: Eagle3, the draft LM; DSpark's sequential
head samples its sampled rows through ``DraftSampler.sample``).

Shapes: R = requests, A = rows drafted now (some of the R), S = sampled rows among them, W = the drafter's
vocabulary (V, or its draft vocabulary).
"""

from __future__ import annotations

import torch

from dspark.drafters.base import RequestState
from dspark.sampling.processing import draw_uniforms, logits_to_probs_rows, sample_with_uniforms


class DraftSampler:
    """The batch's sampling settings, read once per step of a drafter: ``draw`` samples one draft position of some
    requests in a few tensor operations, each row as a call of its own would (``logits_to_probs_rows``), with one
    uniform per sampled request from its generator, in request order (what ``sample_from_probs`` row by row draws,
    so a seeded request drafts the same alone and in any batch)."""

    def __init__(self, requests: list[RequestState]) -> None:
        self.requests = requests
        self.greedy = [r.sampling.greedy for r in requests]
        settings = torch.tensor([[r.sampling.temperature, r.sampling.top_k, r.sampling.top_p] for r in requests],
                                dtype=torch.float64)  # (R, 3)
        self.temps, self.top_k, self.top_p = settings[:, 0].float(), settings[:, 1].long(), settings[:, 2].float()

    def draw(self, logits: torch.Tensor, rows: list[int]  # (A, W) logits of requests ``rows``
             ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:  # (A,) draft indices, sampled i's, (S, W)
        """Greedy rows take the argmax (the one-hot distribution's token); sampled rows draw from their processed
        distribution, which is returned for them."""
        w = logits.argmax(-1)  # (A,) the first best index: what a greedy row's one-hot distribution samples
        sampled = [i for i, r in enumerate(rows) if not self.greedy[r]]
        if not sampled:
            return w, sampled, None
        si = torch.tensor(sampled, device=logits.device)  # (S,)
        w[si], probs = self.sample(logits[si], [rows[i] for i in sampled])
        return w, sampled, probs

    def sample(self, logits: torch.Tensor, rows: list[int]  # (S, W) logits of sampled requests ``rows``
               ) -> tuple[torch.Tensor, torch.Tensor]:  # (S,) draft indices, (S, W) the distributions drawn from
        """Sampled rows only: each row's processed distribution, then one uniform per request from its generator,
        in the order of ``rows``."""
        sr = torch.tensor(rows)  # (S,)
        probs = logits_to_probs_rows(logits, self.temps[sr], self.top_k[sr], self.top_p[sr])  # (S, W)
        uniforms = torch.cat([draw_uniforms(self.requests[r].generator).cpu() for r in rows])  # (S,)
        return sample_with_uniforms(probs, uniforms), probs
