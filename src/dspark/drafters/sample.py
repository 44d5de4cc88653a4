"""One training sequence together with the frozen target's outputs on it.

Shapes: L = sequence length, H = target hidden size, n = len(target_layer_ids),
F = n * H.

``target_features`` are the outputs of ``target_layer_ids`` (HF
``hidden_states[l + 1]``), concatenated in id order; ``target_last_hidden`` is
the target's final-normed, pre-LM-head state. The target's distribution of
token t+1 is ``softmax(lm_head(target_last_hidden[t]))``: the drafter gets d
numbers per token, never V (docs/conventions.md §Target distribution in training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainSample:
    input_ids: torch.Tensor  # (L,) int64
    loss_mask: torch.Tensor  # (L,) int64/bool, nonzero on assistant tokens (2: teacher-forced labelled text)
    target_features: torch.Tensor  # (L, F)
    target_last_hidden: torch.Tensor  # (L, H)
    # (L,) float32 log-sum-exp of the target's logits over all V (a drafter with a draft vocabulary needs it)
    target_logsumexp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        L = self.input_ids.shape[0]
        if self.input_ids.dim() != 1 or self.loss_mask.shape != (L,):
            raise ValueError(
                f"input_ids and loss_mask must be 1-D of one length, got {tuple(self.input_ids.shape)} "
                f"and {tuple(self.loss_mask.shape)}"
            )
        if self.target_features.dim() != 2 or self.target_features.shape[0] != L:
            raise ValueError(f"target_features must be (L={L}, F), got {tuple(self.target_features.shape)}")
        if self.target_last_hidden.dim() != 2 or self.target_last_hidden.shape[0] != L:
            raise ValueError(f"target_last_hidden must be (L={L}, H), got {tuple(self.target_last_hidden.shape)}")
        if self.target_logsumexp is not None and self.target_logsumexp.shape != (L,):
            raise ValueError(f"target_logsumexp must be (L={L},), got {tuple(self.target_logsumexp.shape)}")

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[0]


def make_train_sample(
    target,  # dspark.target.model.TargetModel
    input_ids: list[int] | torch.Tensor,  # (L,)
    loss_mask: list[int] | torch.Tensor | None,  # (L,); None = every token supervised
    target_layer_ids: list[int],
) -> TrainSample:
    """Run the frozen target once over a sequence (no cache) and package its outputs."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    mask = torch.ones_like(ids) if loss_mask is None else torch.as_tensor(loss_mask, dtype=torch.long)
    out = target.forward(ids, [ids.shape[0]], None, capture_layers=list(target_layer_ids), logits_for="none")
    last = out.last_hidden.clone()
    return TrainSample(ids, mask, out.features.clone(), last, target_logsumexp(target, last))


def target_logsumexp(target, last_hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:  # (L, H) -> (L,) fp32
    """log sum_v exp(target logits): normalises the target's distribution on a draft vocabulary (one number
    per token, computed with the full LM head in row chunks)."""
    out = []
    with torch.inference_mode():
        for s in range(0, last_hidden.shape[0], chunk):
            h = last_hidden[s : s + chunk].to(target.model.lm_head.weight.dtype)
            out.append(target.model.logits(h).float().logsumexp(-1))
    return torch.cat(out).clone() if out else last_hidden.new_zeros(0, dtype=torch.float32)
