"""Restricting a full-vocabulary DSpark / DFlash drafter to a draft vocabulary, in memory or as a checkpoint.

Shapes: V = target vocabulary, W = draft vocabulary, H = hidden size, r = Markov rank.

The restricted model keeps the LM-head rows, the Markov head's W1 rows (previous-token
embedding) and W2 rows of the W draft tokens only; everything else is copied unchanged.
Its logits are those of the full model on the W tokens, so drafting from it is the
full model's U_k + B_k renormalised over the draft vocabulary: a different proposal,
still lossless under rejection sampling (docs/training.md §Draft vocabulary). A
previous token outside the draft vocabulary (only the anchor can be) gets a zero
Markov embedding, as in training with a draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters.checkpoint import check_draft_vocab, fill_restricted, head_fingerprint
from dspark.drafters.dspark.model import DSparkModel
from dspark.errors import IncompatibleModelsError


def restrict_to_draft_vocab(model: DSparkModel, vocab_ids: list[int] | torch.Tensor) -> DSparkModel:
    """A copy of ``model`` that drafts only ``vocab_ids`` (W target token ids, most frequent first)."""
    V = model.spec.vocab_size
    ids = check_draft_vocab(vocab_ids, V)
    if model.draft_vocab is not None:
        if torch.equal(model.draft_vocab.cpu(), ids):
            return model
        raise IncompatibleModelsError(
            f"the drafter already has a draft vocabulary of {model.draft_size} tokens; restrict a full-vocabulary one")
    weight = model.lm_head.weight
    out = DSparkModel(model.config, model.spec, model.base_config, model.num_target_layers, ids)
    out.target_fingerprint = model.target_fingerprint or head_fingerprint(weight)
    return fill_restricted(out, model, ids, ("lm_head.weight", "markov_head.markov_w1.weight",
                                             "markov_head.markov_w2.weight"))


def prune_to_draft_vocab(ckpt: str | Path, vocab_ids: list[int] | torch.Tensor, out: str | Path,
                         dtype: torch.dtype = torch.bfloat16, target=None) -> Path:
    """Write the full-vocabulary DSpark/DFlash checkpoint ``ckpt`` restricted to ``vocab_ids`` into ``out``.

    The result stores ``draft_vocab`` (W,) int64 and ``draft_vocab_size`` in config.json, the LM-head-free
    Markov rows over the W tokens, and leaves out the frozen embed_tokens / lm_head (loaded from the target
    at decoding time). ``target`` is needed only when ``ckpt`` itself lacks embed_tokens / lm_head.
    Returns ``out``."""
    model = DSparkModel.from_checkpoint(Path(ckpt), target)
    restrict_to_draft_vocab(model, vocab_ids).save_checkpoint(Path(out), dtype)
    return Path(out)
