"""The draft LM's distillation loss: KL(target || draft) on assistant next tokens.

Loss, per sequence: mean over supervised positions t (the next token t+1 is an
assistant token, ``loss_mask[t+1] = 1``) of

    KL(target_probs_t || draft_probs_t) = sum_v target_probs log(target_probs / draft_probs)

plus ``ce_loss_alpha`` times the hard-label cross-entropy (0 by default). Where the next
token's ``loss_mask`` is ``TARGET_LABEL`` (labelled existing text) the hard label is the
target's argmax, not the data token (docs/training.md §Teacher-forced labelling). V-sized
tensors exist only for ``ROW_CHUNK`` rows at a time, recomputed in backward.

Shapes: L = sequence length, M = supervised positions, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dspark.drafters.draft_lm.config import DraftLMConfig
from dspark.drafters.draft_lm.model import DraftLMModel, DraftLMOutputs
from dspark.drafters.losses import ROW_CHUNK, TARGET_LABEL, connected_zero, target_argmax_labels
from dspark.drafters.sample import TrainSample


def kl_row_terms(
    draft_logits: torch.Tensor,  # (m, V)
    target_logits: torch.Tensor,  # (m, V) no grad needed
    labels: torch.Tensor,  # (m,) int64 next tokens
    from_target: torch.Tensor | None = None,  # (m,) bool: CE label = the target's argmax
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # kl (m,), ce (m,), soft acceptance (m,) (no grad)
    """KL(target_probs || draft_probs), hard-label CE and sum_v min(draft_probs, target_probs), at T = 1."""
    labels = target_argmax_labels(labels, target_logits, from_target)
    draft_logp = torch.log_softmax(draft_logits.float(), dim=-1)  # (m, V)
    target_logp = torch.log_softmax(target_logits.float(), dim=-1).detach()
    target_probs = target_logp.exp()
    kl = (target_probs * (target_logp - draft_logp)).sum(-1)
    ce = -draft_logp.gather(-1, labels[:, None]).squeeze(-1)
    with torch.no_grad():
        acc = torch.minimum(draft_logp.exp(), target_probs).sum(-1)
    return kl, ce, acc


class DraftLMLoss(nn.Module):
    def __init__(self, config: DraftLMConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, model: DraftLMModel, outputs: DraftLMOutputs, sample: TrainSample
                ) -> tuple[torch.Tensor, dict[str, float]]:
        """KL(target || draft) on assistant next tokens (+ ce_loss_alpha * CE), and metrics."""
        ids = sample.input_ids
        rows = (sample.loss_mask[1:] > 0).nonzero().squeeze(-1)  # (M,) positions t whose next token is supervised
        metrics: dict[str, float] = {"supervised_tokens": float(rows.numel())}
        if rows.numel() == 0:
            return connected_zero(model), {**metrics, "loss": 0.0}
        hidden = outputs.hidden[rows]  # (M, H)
        target_hidden = sample.target_last_hidden[rows]  # (M, H)
        labels = ids[rows + 1]  # (M,)
        from_target = sample.loss_mask[rows + 1] == TARGET_LABEL  # (M,) bool

        def one(h, t_hidden, lab, from_t):
            with torch.no_grad():
                target_logits = model.teacher_logits(t_hidden)
            return kl_row_terms(model.lm.logits(h), target_logits, lab, from_t)

        use_ckpt = torch.is_grad_enabled()
        parts = []
        for s in range(0, rows.numel(), ROW_CHUNK):
            args = (hidden[s : s + ROW_CHUNK], target_hidden[s : s + ROW_CHUNK], labels[s : s + ROW_CHUNK],
                    from_target[s : s + ROW_CHUNK])
            parts.append(checkpoint(one, *args, use_reentrant=False) if use_ckpt else one(*args))
        kl, ce, acc = (torch.cat(x) for x in zip(*parts))
        loss = kl.mean()
        if self.config.ce_loss_alpha > 0:
            loss = loss + self.config.ce_loss_alpha * ce.mean()
        metrics.update(loss=float(loss.detach()), kl=float(kl.detach().mean()), ce=float(ce.detach().mean()),
                       acc=float(acc.mean()))  # acc: expected acceptance of one draft token, sum_v min(p_d, p_t)
        return loss, metrics
