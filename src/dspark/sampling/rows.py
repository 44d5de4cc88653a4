"""The processed target distributions of a verify step, computed a few rows at a time where the sampler reads them.

Shapes: N = verify rows of the batch (requests concatenated), R = requests, K = most drafts a request verifies,
V = vocabulary size.

Rejection sampling reads each draft's target probability and one whole row per request (the one its recovered or
bonus token comes from). Building every row's distribution at once, (N, V) float32, then an (R, K + 1, V) copy, is
what made a sampled step's host work grow with the batch: 25 MB at 16 requests verifying 7 drafts of SmolLM2's
49,152 tokens, allocated, page-faulted in and copied twice per step. ``TargetRows`` runs ``logits_to_probs_rows``
on ``CHUNK_ELEMENTS`` worth of rows at a time and keeps only the probabilities it is asked for; every operation of
``logits_to_probs_rows`` works row by row, so each value is bit for bit what the whole tensor holds
(``tests/sampling/test_rows.py``).
"""

from __future__ import annotations

import torch

from dspark.sampling.processing import SamplingParams, logits_to_probs_rows

#: float32 entries of distributions built at once (2 MiB): a handful of rows of a 49,152-token vocabulary
CHUNK_ELEMENTS = 1 << 19


class TargetRows:
    """``Rows`` (``dspark.sampling.rejection``) of a verify step's target: request r owns the ``seq_lens[r]``
    consecutive logits rows from ``sum(seq_lens[:r])`` on, each processed with the request's sampling settings."""

    def __init__(
        self,
        logits: torch.Tensor,  # (N, V) verify logits, requests concatenated
        settings: list[SamplingParams],  # (R,) each request's
        seq_lens: list[int],  # (R,) rows per request (1 + verify_len)
    ) -> None:
        if len(settings) != len(seq_lens) or sum(seq_lens) != logits.shape[0]:
            raise ValueError(f"{len(settings)} requests with {sum(seq_lens)} rows for {logits.shape[0]} logits rows")
        self.logits = logits
        self.seq_lens = seq_lens
        dev = logits.device
        lens = torch.tensor(seq_lens)
        self.starts = (lens.cumsum(0) - lens).to(dev)  # (R,) each request's first row
        per_request = torch.tensor([[s.temperature, s.top_k, s.top_p] for s in settings], dtype=torch.float64)
        token_req = torch.repeat_interleave(torch.arange(len(settings)), lens)  # (N,)
        row_settings = per_request[token_req].to(dev)  # (N, 3)
        self.temperature = row_settings[:, 0].float()
        self.top_k = row_settings[:, 1].long()
        self.top_p = row_settings[:, 2].float()

    def _probs(self, rows: torch.Tensor) -> torch.Tensor:  # (M,) flat rows -> (M, V) float32
        return logits_to_probs_rows(self.logits[rows], self.temperature[rows], self.top_k[rows], self.top_p[rows])

    def at(self, tokens: torch.Tensor) -> torch.Tensor:  # (R, K) -> (R, K) float32, 0 past each request's drafts
        """The processed target probability of ``tokens[r, k]`` at request r's row k, for the rows of its drafts
        (k < seq_lens[r] - 1; the row after them gives only a bonus token, read whole by ``rows``)."""
        R, K = tokens.shape
        dev = self.logits.device
        tokens = tokens.to(dev)
        drafts = torch.tensor(self.seq_lens, device=dev) - 1  # (R,)
        inside = torch.arange(K, device=dev)[None, :] < drafts[:, None]  # (R, K)
        req, pos = inside.nonzero(as_tuple=True)  # (M,) each
        flat = self.starts[req] + pos  # (M,) logits rows
        picked = tokens[req, pos]  # (M,)
        values = torch.empty(len(flat), device=dev)
        step = max(1, CHUNK_ELEMENTS // self.logits.shape[-1])
        for i in range(0, len(flat), step):
            values[i : i + step] = self._probs(flat[i : i + step]).gather(-1, picked[i : i + step, None]).squeeze(-1)
        out = torch.zeros(R, K, device=dev)
        out[req, pos] = values
        return out

    def rows(self, index: torch.Tensor) -> torch.Tensor:  # (R,) in 0..seq_lens[r]-1 -> (R, V) float32
        """Request r's processed distribution at its row ``index[r]``."""
        return self._probs(self.starts + index.to(self.starts.device))
