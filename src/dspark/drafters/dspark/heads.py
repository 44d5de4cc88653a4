"""DSpark's heads on the backbone's hidden states: the sequential head (eqs. 5-6) and the confidence head (eq. 7).

Shapes: N = rows, A = blocks, G = block size (gamma), H = hidden size, V = vocabulary,
r = Markov rank, M = candidate tokens.

Names follow DeepSpec (``markov_head.{markov_w1,markov_w2,joint_proj}``, ``confidence_head.proj``).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Sequential head: vanilla Markov bias eq. (5) or gated RNN bias eq. (6)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        self.rank, self.head_type = rank, head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # W1: V x r lookup
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # W2: r -> V
        if head_type == "rnn":
            # W_g, W_c, W_o as one linear over z = [s_{k-1}; W1[x_{k-1}]; h_k], split in three
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor:  # (...,) -> (..., r)
        return self.markov_w1(prev)

    def step(
        self,
        state: torch.Tensor | None,  # (N, r) s_{k-1}; None = s_0 = 0
        hidden: torch.Tensor,  # (N, H) h_k
        prev: torch.Tensor,  # (N,) x_{k-1}
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # new state (N, r) or None, latent u_k (N, r); B_k = W2 u_k
        e = self.prev_embed(prev).to(hidden.dtype)  # (N, r)
        if self.head_type == "vanilla":
            return None, e  # eq. (5): B_k = W2 W1[x_{k-1}]
        if state is None:
            state = hidden.new_zeros(hidden.shape[0], self.rank)
        z = torch.cat([state, e, hidden], dim=-1)  # (N, 2r + H)
        gate, cand, out = self.joint_proj(z).chunk(3, dim=-1)  # eq. (6)
        gate = torch.sigmoid(gate)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return new_state, torch.tanh(out)

    def latents(
        self,
        hidden: torch.Tensor,  # (A, G, H)
        prev: torch.Tensor,  # (A, G) teacher-forced previous tokens
    ) -> torch.Tensor:  # (A, G, r)
        if self.head_type == "vanilla":
            return self.prev_embed(prev).to(hidden.dtype)
        state, out = None, []
        for k in range(hidden.shape[1]):
            state, u = self.step(state, hidden[:, k], prev[:, k])
            out.append(u)
        return torch.stack(out, dim=1)

    def bias(self, latent: torch.Tensor) -> torch.Tensor:  # (..., r) -> (..., V)
        return self.markov_w2(latent)

    def bias_at(self, latent: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """B_k at some tokens only: (N, r), (N, M) token ids -> (N, M). Reads M rows of W2 instead of all V."""
        rows = self.markov_w2.weight[candidates]  # (N, M, r)
        return (rows @ latent.to(rows.dtype)[:, :, None])[..., 0]  # (N, M)


class ConfidenceHead(nn.Module):
    """DeepSpec's ``AcceptRatePredictor``: one linear unit, eq. (7)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (...,)
        return self.proj(x).squeeze(-1)
