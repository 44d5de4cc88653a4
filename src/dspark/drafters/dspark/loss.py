"""The DSpark / DFlash training loss, eqs. (8)-(12), on the model's teacher-forced block outputs.

Shapes: A = blocks, G = block size (gamma), M = supervised rows (flattened
(block, slot) pairs with a positive weight), V = vocabulary, W = draft vocabulary
(V without one), H = hidden size, r = Markov rank.

Paper §3.3 (docs/conventions.md §Training losses):
- position weight w_k = exp(-k / g) * eval_mask, k = 0..G-1 (DeepSpec; the paper's
  exp(-(k-1)/gamma) with 1-based k is g = gamma);
- CE on the Markov-corrected, teacher-forced logits against the hard label, eq. (9);
- L1 = sum_v |draft_probs - target_probs| (twice the total variation), eq. (10);
- BCE-with-logits of the confidence head against the detached soft label
  c* = clamp(1 - L1/2, 0, 1) = sum_v min(draft_probs, target_probs), eqs. (8), (11);
- each term is sum(w * term) / sum(w); total = a_ce CE + a_l1 L1 + a_conf BCE, eq. (12).

The W-sized logits of the supervised rows are built here through the model's heads
(``draft_logits``, ``target_logits``): see ``chunked_row_terms``. With a draft vocabulary
the target distribution is the full one restricted to the W tokens (normalised by the
sample's ``target_logsumexp``); CE skips labels outside; docs/training.md §Draft vocabulary.

A row whose label token has ``loss_mask`` = ``TARGET_LABEL`` (teacher-forced labelling of
existing text) takes the target's argmax as its CE label instead of the data token (over
the W tokens with a draft vocabulary); docs/training.md §Teacher-forced labelling.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkModel, DSparkOutputs
from dspark.drafters.losses import (
    TARGET_LABEL,
    chunked_row_terms,
    confidence_bce,
    connected_zero,
    position_weights,
    tau_estimate,
    weighted_mean,
)
from dspark.drafters.sample import TrainSample
from dspark.errors import DSparkError


class DSparkLoss(nn.Module):
    """Loss of eq. (12) on one sequence, and metrics (ce, l1, bce, acc@k, tau, ...)."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, model: DSparkModel, outputs: DSparkOutputs, sample: TrainSample
                ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        metrics: dict[str, float] = {"num_blocks": float(outputs.anchors.numel()), "supervised_tokens": 0.0,
                                     "weight_sum": 0.0}
        if outputs.blocks is None:
            return connected_zero(model), {**metrics, "loss": 0.0}
        blocks = outputs.blocks
        s = cfg.slot_offset  # anchor + k convention: slot 0 drafts nothing, draft k sits in slot k + s
        weights = torch.zeros(blocks.eval_mask.shape, device=blocks.eval_mask.device)  # (A, G)
        weights[:, s:] = position_weights(blocks.eval_mask[:, s:], cfg.loss_decay_gamma)
        rows = blocks.eval_mask.flatten().nonzero().squeeze(-1)  # (M,) supervised (block, slot) pairs
        if rows.numel() == 0:
            return connected_zero(model), {**metrics, "loss": 0.0}
        H = outputs.hidden.shape[-1]
        hidden = outputs.hidden.reshape(-1, H)[rows]  # (M, H)
        latents = outputs.latents
        if latents is not None:
            latents = latents.reshape(-1, latents.shape[-1])[rows]  # (M, r)
        target_rows = blocks.target_index.flatten()[rows]  # (M,)
        target_hidden = sample.target_last_hidden[target_rows]  # (M, H)
        labels = model.draft_index(blocks.labels.flatten()[rows])  # (M,) w, -1 outside the draft vocabulary
        # supervised rows predict position target_rows + 1 < L; TARGET_LABEL there: CE label = the target's argmax
        from_target = sample.loss_mask[target_rows + 1] == TARGET_LABEL  # (M,) bool
        w = weights.flatten()[rows]  # (M,)
        lse = None
        if model.draft_vocab is not None:
            if sample.target_logsumexp is None:
                raise DSparkError("a drafter with a draft vocabulary trains on samples with the target's "
                                  "target_logsumexp (feature cache or online samples built for it)")
            lse = sample.target_logsumexp[target_rows]  # (M,)
        ce, l1 = chunked_row_terms(model.draft_logits, model.target_logits, (hidden, latents), target_hidden, labels,
                                   target_lse=lse, vocab=model.draft_size, from_target=from_target)
        soft = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)  # eq. (8): c* = sum_v min(p_d, p_t)
        ce_w = w if lse is None else w * ((labels >= 0) | from_target)  # CE only where the label can be drafted
        loss_ce = weighted_mean(ce, ce_w)  # eq. (9)
        loss_l1 = weighted_mean(l1, w)  # eq. (10)
        total = cfg.ce_loss_alpha * loss_ce
        if cfg.l1_loss_alpha > 0:
            total = total + cfg.l1_loss_alpha * loss_l1
        metrics.update(ce=float(loss_ce.detach()), l1=float(loss_l1.detach()))
        if outputs.confidence_logits is not None:
            conf = outputs.confidence_logits.flatten()[rows]
            loss_bce = weighted_mean(confidence_bce(conf, soft), w)  # eq. (11)
            total = total + cfg.confidence_head_alpha * loss_bce
            metrics["bce"] = float(loss_bce.detach())
            metrics["confidence_abs_error"] = float(weighted_mean((torch.sigmoid(conf.detach()) - soft).abs(), w))
        metrics.update(acceptance_metrics(soft, rows, blocks.eval_mask, s))
        metrics["supervised_tokens"] = float(rows.numel())
        metrics["weight_sum"] = float(w.sum())  # the denominator of every term (for global re-weighting)
        metrics["loss"] = float(total.detach())
        return total, metrics  # eq. (12)


def acceptance_metrics(
    soft: torch.Tensor,  # (M,) soft acceptance of the supervised rows
    rows: torch.Tensor,  # (M,) their flat (block, slot) indices
    eval_mask: torch.Tensor,  # (A, G) bool
    slot_offset: int = 0,
) -> dict[str, float]:
    """acc@k = mean soft acceptance sum_v min(p_d, p_t) over supervised drafts k; tau = 1 + sum prod acc.
    Draft k sits in slot k + ``slot_offset``."""
    grid = torch.zeros(eval_mask.numel(), device=soft.device)
    grid[rows] = soft.float()
    grid = grid.view(eval_mask.shape)[:, slot_offset:]
    eval_mask = eval_mask[:, slot_offset:]
    out: dict[str, float] = {}
    counts = eval_mask.sum(0)
    for k in range(eval_mask.shape[1]):
        if int(counts[k]) > 0:
            out[f"acc@{k}"] = float(grid[:, k].sum() / counts[k])
    tau = tau_estimate(grid, eval_mask)
    if not math.isnan(tau):
        out["tau"] = tau
    return out
