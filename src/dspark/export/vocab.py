"""`dspark export --to vocab`: a full-vocabulary DSpark/DFlash checkpoint restricted to a draft vocabulary.

The result carries its draft vocabulary (``draft_vocab`` in model.safetensors, ``draft_vocab_size`` in
config.json), so decoding needs no ``--draft-vocab`` file; it leaves out the frozen embeddings and LM
head (taken from the target when loaded). See ``dspark.drafters.dspark.vocab.prune_to_draft_vocab``.
"""

from __future__ import annotations

from pathlib import Path


def export_vocab(checkpoint: str | Path, vocab: str | Path, out: str | Path, dtype: str = "bfloat16",
                 target: str | None = None) -> tuple[Path, int]:
    """Write ``checkpoint`` restricted to the `dspark data vocab` file ``vocab`` into ``out`` in ``dtype``;
    ``target`` (preset or folder) is read only when the checkpoint lacks embed_tokens/lm_head. Returns the
    folder written and the draft vocabulary's size."""
    from dspark.drafters.draft_vocab import load_draft_vocab
    from dspark.drafters.dspark.vocab import prune_to_draft_vocab
    from dspark.target.loading import torch_dtype
    from dspark.modeling.weights import read_config

    loaded = None
    if target:
        from dspark.target.model import load_target

        loaded = load_target(target, tokenizer=False)
    vocab_size = int(read_config(Path(checkpoint))["vocab_size"])
    ids = load_draft_vocab(vocab, vocab_size)
    return prune_to_draft_vocab(checkpoint, ids, out, torch_dtype(dtype), loaded), len(ids)
