"""Training blocks of the parallel drafter: anchors, block inputs, labels, eval mask, attention mask.

Follows DeepSpec's sampler (docs/conventions.md §Blocks and slots).

Shapes: L = sequence length, A = kept anchors (<= num_anchors), G = block size
(gamma), Q = A * G block tokens.

- An anchor candidate is a position i in [0, L-2] with loss_mask[i] = loss_mask[i+1] = 1.
  Up to ``num_anchors`` are drawn uniformly without replacement, then sorted.
- Block inputs: slot 0 = input_ids[anchor], slots 1..G-1 = mask_token_id.
- Slot k (0-based) predicts the token at anchor + k + 1, so all G slots are trained;
  it sits at RoPE position anchor + k. With ``slot_offset`` 1 (the anchor + k convention) slot k
  predicts anchor + k and slot 0 is not trained (docs/interop.md §Slot conventions).
- eval_mask[b, k] = (anchor+k+1 < L) & loss_mask[anchor+k+1], then a cumulative
  product over k: only the contiguous supervised prefix counts.
- Attention: block b sees context (target features) at positions j < anchor_b and
  the G slots of its own block, bidirectionally; nothing of other blocks.

DeepSpec pads to exactly ``num_anchors`` blocks with a ``block_keep_mask``; a dropped
block sees nothing and has an all-zero eval mask, so it contributes nothing. Here
dropped blocks are simply not built (also avoids fully masked attention rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:  # (L,) -> (L-1,) bool
    """Positions i in [0, L-2] whose token and next token are both supervised."""
    m = loss_mask.bool()
    if m.shape[0] < 2:
        return m[:0]
    return m[:-1] & m[1:]


def sample_anchors(
    loss_mask: torch.Tensor,  # (L,)
    num_anchors: int,
    generator: torch.Generator | None,
) -> torch.Tensor:  # (A,) int64, sorted ascending, A = min(num_anchors, #candidates)
    """Up to ``num_anchors`` anchor positions, uniformly without replacement."""
    candidates = anchor_candidates(loss_mask).nonzero().squeeze(-1)  # (C,)
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors].to(candidates.device)
        candidates = candidates[pick]
    return candidates.sort().values


@dataclass
class Blocks:
    """The packed blocks of one sequence."""

    anchors: torch.Tensor  # (A,) int64
    block_ids: torch.Tensor  # (A, G) int64 block input tokens: anchor token, then mask tokens
    positions: torch.Tensor  # (A, G) int64 RoPE positions anchor + k
    labels: torch.Tensor  # (A, G) int64 token at anchor + k + 1 (clamped index where out of range)
    prev_tokens: torch.Tensor  # (A, G) int64 teacher-forced previous token: anchor, then labels[:, :-1]
    target_index: torch.Tensor  # (A, G) int64 anchor + k (clamped): target_last_hidden row giving p_t
    eval_mask: torch.Tensor  # (A, G) bool, contiguous supervised prefix

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[0]

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[1]


def build_blocks(
    input_ids: torch.Tensor,  # (L,) int64
    loss_mask: torch.Tensor,  # (L,)
    anchors: torch.Tensor,  # (A,) int64
    block_size: int,
    mask_token_id: int,
    slot_offset: int = 0,
) -> Blocks:
    """``slot_offset`` s = 1 is the anchor + k convention (z-lab/SpecForge DFlash, vLLM's DFlash): slot k predicts
    anchor + k, so slot 0 (the anchor) drafts nothing and is never supervised; s = 0 is DeepSpec's."""
    L, G, s = input_ids.shape[0], block_size, slot_offset
    offsets = torch.arange(G, device=input_ids.device)  # (G,)
    positions = anchors[:, None] + offsets[None, :]  # (A, G)
    label_pos = positions + 1 - s  # (A, G) slot k predicts anchor + k + 1 - s
    safe = label_pos.clamp(max=L - 1)
    labels = input_ids[safe]  # (A, G)
    eval_mask = (label_pos < L) & loss_mask.bool()[safe] & (offsets >= s)[None, :]
    eval_mask[:, s:] = eval_mask[:, s:].long().cumprod(dim=1).bool()
    block_ids = torch.full((anchors.shape[0], G), mask_token_id, dtype=torch.long, device=input_ids.device)
    block_ids[:, 0] = input_ids[anchors]
    prev = input_ids[(label_pos - 1).clamp(min=0, max=L - 1)]  # (A, G) the token before each label
    # The target's distribution of the token at t+1 comes from its hidden state at t, so the
    # label of slot k (token anchor+k+1-s) is scored against target_last_hidden[anchor + k - s].
    target_index = (label_pos - 1).clamp(min=0, max=L - 1)
    return Blocks(anchors, block_ids, positions, labels, prev, target_index, eval_mask)


def block_attention_mask(
    anchors: torch.Tensor,  # (A,) int64
    seq_len: int,
    block_size: int,
) -> torch.Tensor:  # (Q, L + Q) bool, True = may attend; keys are [context (L); blocks (Q)]
    """Block b: context j < anchor_b, plus its own G slots (bidirectional)."""
    A, G = anchors.shape[0], block_size
    q_block = torch.arange(A * G, device=anchors.device) // G  # (Q,)
    ctx = torch.arange(seq_len, device=anchors.device)[None, :] < anchors[q_block][:, None]  # (Q, L)
    own = q_block[:, None] == q_block[None, :]  # (Q, Q)
    return torch.cat([ctx, own], dim=1)
