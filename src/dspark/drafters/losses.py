"""Loss maths shared by the drafter kinds' loss modules (``dspark/loss.py``, ``eagle3/loss.py``,
``draft_lm/loss.py``): position weights, weighted means, per-row CE / L1 (eqs. 9-10), the
confidence BCE (eq. 11), Eagle3's soft cross-entropy, the tau estimate.

Shapes: A = blocks, G = block size (gamma), M = supervised rows, V = vocabulary,
W = draft vocabulary (V without one), H = hidden size.

V-sized tensors (logits, probabilities) are only built for supervised rows. When all
rows fit in ``ELEMENT_BUDGET`` elements (a draft vocabulary, the usual anchor counts)
the terms are one tensor expression over all rows; otherwise chunks of at least
``ROW_CHUNK`` rows under activation checkpointing keep memory bounded however many
anchors a sequence has.

Draft vocabulary (docs/training.md §Draft vocabulary): the draft distribution lives on
the W tokens; the target's stays the full-vocabulary one, restricted to the W tokens
without renormalising (``target_lse`` = its log-sum-exp over all V). Its mass outside
is a constant of the L1 term (the draft puts 0 there), and CE skips rows whose label
is outside (label index -1): the draft cannot propose it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

#: rows of V-sized tensors materialised at once when the rows do not fit ELEMENT_BUDGET
ROW_CHUNK = 128
#: logits elements (rows x vocabulary) computed in one expression without checkpointing
ELEMENT_BUDGET = 2**22
#: added to every weighted-mean denominator (DeepSpec)
DEN_EPS = 1e-6


def position_weights(
    eval_mask: torch.Tensor,  # (A, G) bool
    decay_gamma: float | None,
) -> torch.Tensor:  # (A, G) float32
    """w_k = exp(-k / decay_gamma) on supervised slots, 0 elsewhere; no decay if gamma is None or <= 0."""
    w = eval_mask.float()
    if decay_gamma is not None and decay_gamma > 0:
        k = torch.arange(eval_mask.shape[-1], dtype=torch.float32, device=eval_mask.device)
        w = w * torch.exp(-k / float(decay_gamma))
    return w


def soft_acceptance(
    draft_probs: torch.Tensor,  # (..., V)
    target_probs: torch.Tensor,  # (..., V)
) -> torch.Tensor:  # (...,)
    """Expected acceptance of one draft step, clamp(1 - ||draft - target||_1 / 2, 0, 1), eq. (8)."""
    return (1.0 - 0.5 * (draft_probs - target_probs).abs().sum(-1)).clamp(0.0, 1.0)


def connected_zero(model: nn.Module) -> torch.Tensor:  # ()
    """A zero loss that touches every trainable parameter (keeps DDP's gradient buckets complete)."""
    params = list(model.trainable_parameters())
    return sum((p.sum() * 0.0 for p in params), torch.zeros((), device=params[0].device))


def weighted_mean(term: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (...) x (...) -> ()
    return (term * weights).sum() / (weights.sum() + DEN_EPS)


def row_terms(
    draft_logits: torch.Tensor,  # (M, W) Markov-corrected draft logits
    target_logits: torch.Tensor,  # (M, W) target logits (no grad needed)
    labels: torch.Tensor,  # (M,) int64 ground-truth next tokens as draft indices; -1 = outside
    target_lse: torch.Tensor | None = None,  # (M,) the target's log-sum-exp over all V; None: W = V
) -> tuple[torch.Tensor, torch.Tensor]:  # ce (M,) (0 where the label is outside), l1 (M,)
    """Per-row CE, eq. (9), and L1 distance, eq. (10), at temperature 1, over the full vocabulary."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)  # (M, W)
    ce = -logp.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)
    if target_lse is None:
        target_probs = torch.softmax(target_logits.float(), dim=-1).detach()
        l1 = (logp.exp() - target_probs).abs().sum(-1)
    else:  # p_t on the W tokens, unnormalised there; the draft's 0 outside adds the mass outside to L1
        target_probs = torch.exp(target_logits.float() - target_lse.float()[:, None]).detach()
        outside = (1.0 - target_probs.sum(-1)).clamp(min=0.0)
        l1 = (logp.exp() - target_probs).abs().sum(-1) + outside
        ce = ce * (labels >= 0)
    return ce, l1


def chunked_row_terms(
    draft_logits_fn: Callable[..., torch.Tensor],  # (*row_inputs chunk) -> (m, V)
    target_logits_fn: Callable[[torch.Tensor], torch.Tensor],  # (m, H) -> (m, V)
    row_inputs: tuple[torch.Tensor | None, ...],  # each (M, ...) or None
    target_hidden: torch.Tensor,  # (M, H)
    labels: torch.Tensor,  # (M,) draft indices, -1 = outside the draft vocabulary
    chunk: int | None = None,  # None: all rows at once if they fit ELEMENT_BUDGET, else ROW_CHUNK or more
    target_lse: torch.Tensor | None = None,  # (M,) see row_terms
    vocab: int | None = None,  # W, to size the chunks
) -> tuple[torch.Tensor, torch.Tensor]:  # ce (M,), l1 (M,)
    """``row_terms`` over all rows in one expression, or over row chunks recomputed in backward."""

    def one(t_hidden, lab, lse, *inputs):
        with torch.no_grad():
            target_logits = target_logits_fn(t_hidden)
        return row_terms(draft_logits_fn(*inputs), target_logits, lab, lse)

    M = labels.shape[0]
    if chunk is None:
        chunk = max(ROW_CHUNK, ELEMENT_BUDGET // vocab) if vocab else ROW_CHUNK
    if M <= chunk:  # one tensor expression, no recomputation
        return one(target_hidden, labels, target_lse, *row_inputs)
    use_ckpt = torch.is_grad_enabled() and M > 0
    ces, l1s = [], []
    for s in range(0, M, chunk):
        sl = slice(s, s + chunk)
        lse = target_lse[sl] if target_lse is not None else None
        args = (target_hidden[sl], labels[sl], lse, *[x[sl] if x is not None else None for x in row_inputs])
        if use_ckpt:
            ce, l1 = checkpoint(one, *args, use_reentrant=False)
        else:
            ce, l1 = one(*args)
        ces.append(ce)
        l1s.append(l1)
    if not ces:
        z = target_hidden.new_zeros(0)
        return z, z
    return torch.cat(ces), torch.cat(l1s)


def confidence_bce(
    confidence_logits: torch.Tensor,  # (M,) raw confidence-head logits
    soft_label: torch.Tensor,  # (M,) in [0, 1]
) -> torch.Tensor:  # (M,)
    """Per-row BCE-with-logits against the detached soft label, eq. (11)."""
    return F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_label.detach().float(), reduction="none")


def soft_cross_entropy(
    draft_logits: torch.Tensor,  # (M, V)
    target_probs: torch.Tensor,  # (M, V)
) -> tuple[torch.Tensor, torch.Tensor]:  # soft CE (M,), soft acceptance (M,) (no grad)
    """Eagle3's distillation loss -sum_v target_probs log draft_probs, and the acceptance estimate."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    ce = -(target_probs * logp).sum(-1)
    with torch.no_grad():
        acc = soft_acceptance(logp.exp(), target_probs)
    return ce, acc


def chunked_soft_cross_entropy(
    draft_logits_fn: Callable[[torch.Tensor], torch.Tensor],  # (m, H) -> (m, V)
    target_logits_fn: Callable[[torch.Tensor], torch.Tensor],  # (m, H) -> (m, V)
    hidden: torch.Tensor,  # (M, H) draft hidden states
    target_hidden: torch.Tensor,  # (M, H)
    chunk: int = ROW_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # soft CE (M,), soft acceptance (M,)
    def one(h, t_hidden):
        with torch.no_grad():
            target_probs = torch.softmax(target_logits_fn(t_hidden).float(), dim=-1)
        return soft_cross_entropy(draft_logits_fn(h), target_probs)

    M = hidden.shape[0]
    use_ckpt = torch.is_grad_enabled() and M > 0
    ces, accs = [], []
    for s in range(0, M, chunk):
        args = (hidden[s : s + chunk], target_hidden[s : s + chunk])
        ce, acc = checkpoint(one, *args, use_reentrant=False) if use_ckpt else one(*args)
        ces.append(ce)
        accs.append(acc)
    if not ces:
        z = hidden.new_zeros(0)
        return z, z
    return torch.cat(ces), torch.cat(accs)


def tau_estimate(acceptance: torch.Tensor, mask: torch.Tensor) -> float:  # (A, G) x (A, G) -> scalar
    """Expected acceptance length per block, 1 + sum_k prod_{j<=k} acc_j, averaged over blocks with a supervised slot."""
    valid = mask.any(dim=-1)
    if not bool(valid.any()):
        return math.nan
    expected = (acceptance * mask.float()).cumprod(dim=-1).sum(dim=-1) + 1.0
    return float(expected[valid].mean())
