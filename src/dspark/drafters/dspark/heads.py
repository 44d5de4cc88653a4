"""DSpark's heads on the backbone's hidden states: the sequential head (eqs. 5-6) and the confidence head (eq. 7).

Shapes: N = rows, A = blocks, G = block size (gamma), H = hidden size, W = draft vocabulary
(the target's V without one), r = Markov rank, M = candidate tokens.

Tokens enter the heads as draft indices w in [0, W) (``DSparkModel.draft_index``); -1 marks a previous
token outside the draft vocabulary (only the anchor can be one), whose Markov embedding is zero.

Names follow DeepSpec (``markov_head.{markov_w1,markov_w2,gate_proj,joint_proj}``, ``confidence_head.proj``).
Head types (``markov_head_type``): ``vanilla`` eq. (5); ``gated``, DeepSpec's and SGLang's gated Markov
head, u_k = sigmoid(gate_proj([h_k; W1[x_{k-1}]])) * W1[x_{k-1}] (``gate_proj``: H + r -> r, with bias);
``rnn`` eq. (6). In every type B_k = W2 u_k.
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Sequential head: vanilla Markov bias eq. (5), DeepSpec's gated Markov bias, or the RNN bias eq. (6)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        self.rank, self.head_type = rank, head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # W1: W x r lookup
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # W2: r -> W
        if head_type == "gated":  # gate over [h_k; W1[x_{k-1}]], DeepSpec's GatedMarkovHead
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        if head_type == "rnn":
            # W_g, W_c, W_o as one linear over z = [s_{k-1}; W1[x_{k-1}]; h_k], split in three
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor:  # (...,) w, -1 = outside -> (..., r)
        """W1[x_{k-1}]; zero for a previous token outside the draft vocabulary."""
        e = self.markov_w1(prev.clamp(min=0))
        return e * (prev >= 0).unsqueeze(-1).to(e.dtype)

    def step(
        self,
        state: torch.Tensor | None,  # (N, r) s_{k-1}; None = s_0 = 0
        hidden: torch.Tensor,  # (N, H) h_k
        prev: torch.Tensor,  # (N,) w of x_{k-1}
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # new state (N, r) or None, latent u_k (N, r); B_k = W2 u_k
        e = self.prev_embed(prev).to(hidden.dtype)  # (N, r)
        if self.head_type == "vanilla":
            return None, e  # eq. (5): B_k = W2 W1[x_{k-1}]
        if self.head_type == "gated":  # B_k = W2 (sigmoid(gate_proj([h_k; e])) * e)
            return None, torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e
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
        prev: torch.Tensor,  # (A, G) w of the teacher-forced previous tokens
    ) -> torch.Tensor:  # (A, G, r)
        if self.head_type == "vanilla":
            return self.prev_embed(prev).to(hidden.dtype)
        if self.head_type == "gated":  # memoryless: every slot at once
            e = self.prev_embed(prev).to(hidden.dtype)  # (A, G, r)
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e
        state, out = None, []
        for k in range(hidden.shape[1]):
            state, u = self.step(state, hidden[:, k], prev[:, k])
            out.append(u)
        return torch.stack(out, dim=1)

    def bias(self, latent: torch.Tensor) -> torch.Tensor:  # (..., r) -> (..., W)
        return self.markov_w2(latent)

    def bias_at(self, latent: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """B_k at some tokens only: (N, r), (N, M) draft indices -> (N, M). Reads M rows of W2 instead of all W."""
        rows = self.markov_w2.weight[candidates]  # (N, M, r)
        return (rows @ latent.to(rows.dtype)[:, :, None])[..., 0]  # (N, M)


class ConfidenceHead(nn.Module):
    """DeepSpec's ``AcceptRatePredictor``: one linear unit, eq. (7)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (...,)
        return self.proj(x).squeeze(-1)
