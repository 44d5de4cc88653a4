"""Eagle3's training-time-test loss: decayed soft cross-entropy against the target, per TTT step.

Shapes: L = sequence length, M = supervised positions of a step, H = hidden size, T = ttt_length.

Step s at position i is scored against the target's distribution at i + 1 + s (the token
x_{i+2+s}) where ``loss_mask[i + s]`` holds and a next position exists. Loss:
sum_s decay^s * (sum_i mask_s[i] softCE_s[i]) / L (DeepSpec normalises by B*T); metrics
acc@s (soft acceptance) and tau (expected acceptance length of chains started at i).

Draft vocabulary (W tokens): the teacher is the target's full distribution restricted to the
W tokens without renormalising (its logits over W minus the sample's ``target_logsumexp``),
computed once per sequence for every step; its mass outside the W tokens lowers the
acceptance estimate and adds a constant the CE leaves out (docs/training.md §Draft vocabulary).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import Eagle3Model, Eagle3Outputs
from dspark.drafters.losses import chunked_restricted_soft_cross_entropy, chunked_soft_cross_entropy, connected_zero
from dspark.drafters.sample import TrainSample
from dspark.errors import DSparkError


def eagle3_step_weight(step: int, step_loss_decay: float) -> float:
    """Weight of training-time-test step ``step`` (0-based): decay ** step (0.8 in DeepSpec)."""
    return float(step_loss_decay) ** step


class Eagle3Loss(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config

    def forward(self, model: Eagle3Model, outputs: Eagle3Outputs, sample: TrainSample
                ) -> tuple[torch.Tensor, dict[str, float]]:
        L = sample.seq_len
        # mask of step 0 at position i: loss_mask[i] and a next position exists; step s shifts it by s
        mask0 = sample.loss_mask.bool().clone()
        mask0[-1] = False
        total = connected_zero(model)
        metrics: dict[str, float] = {}
        dev = sample.input_ids.device
        expected, alive = torch.zeros((), device=dev), None
        teacher = None  # (L, W) the target's probabilities on the draft vocabulary, for every step
        if model.draft_vocab is not None:
            if sample.target_logsumexp is None:
                raise DSparkError("an Eagle3 drafter with a draft vocabulary trains on samples with the target's "
                                  "target_logsumexp (feature cache or online samples built for it)")
            with torch.no_grad():
                logits = model.target_logits(sample.target_last_hidden).float()  # (L, W)
                teacher = torch.exp(logits - sample.target_logsumexp.float()[:, None])
        for s, hidden in enumerate(outputs.hidden):
            mask = torch.cat([mask0[s:], mask0.new_zeros(min(s, L))])[:L]  # (L,) = mask0[i + s]
            rows = mask.nonzero().squeeze(-1)  # (M,)
            if rows.numel() == 0:
                continue
            # teacher: the target's distribution at i + 1 + s (the token x_{i+2+s})
            if teacher is None:
                ce, acc = chunked_soft_cross_entropy(model.logits, model.target_logits, hidden[rows],
                                                     sample.target_last_hidden[rows + 1 + s])
            else:
                ce, acc = chunked_restricted_soft_cross_entropy(model.logits, hidden[rows], teacher[rows + 1 + s])
            step_loss = ce.sum() / L
            total = total + eagle3_step_weight(s, self.config.step_loss_decay) * step_loss
            metrics[f"ploss_{s}"] = float(step_loss.detach())
            metrics[f"acc@{s}"] = float(acc.mean())
            if s == 0:
                alive = torch.zeros(L, device=dev)
                alive[rows] = 1.0
                starts = alive.sum()
            step_acc = torch.zeros(L, device=dev)
            step_acc[rows] = acc.float()
            alive = alive * step_acc  # chains that start at i: prod of acceptances up to step s
            expected = expected + alive.sum()
        if alive is not None and float(starts) > 0:
            metrics["tau"] = float(1.0 + expected / starts)
        metrics["loss"] = float(total.detach())
        return total, metrics
