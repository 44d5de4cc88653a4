"""Building a draft vocabulary (`dspark data vocab`): the tokens the target generates most often.

Counts the supervised (assistant) tokens of a tokenized training set and keeps the N most frequent;
the file format and its loader are in `dspark.drafters.draft_vocab`, which explains why a drafter
restricted to these tokens still decodes losslessly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np

from dspark.data.tokenized import TokenizedDataset
from dspark.drafters.draft_vocab import save_draft_vocab
from dspark.errors import DSparkError


def count_tokens(data_dir: str | Path, vocab_size: int) -> np.ndarray:  # (V,) int64 counts of supervised tokens
    ds = TokenizedDataset(data_dir)
    items = (ds[i] for i in range(len(ds)))
    return count_sequences(((it["input_ids"], it["loss_mask"]) for it in items), vocab_size, str(data_dir))


def count_sequences(sequences: Iterable[tuple[Any, Any]], vocab_size: int, source: str) -> np.ndarray:  # (V,) int64
    """Counts of the supervised tokens of (input_ids (L,), loss_mask (L,)) pairs (tokenized data or a feature cache)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for input_ids, loss_mask in sequences:
        ids = np.asarray(input_ids)[np.asarray(loss_mask).astype(bool)]
        if ids.size and int(ids.max()) >= vocab_size:
            raise DSparkError(f"{source}: token id {int(ids.max())} outside a vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: np.ndarray, size: int, always: list[int] = ()) -> tuple[list[int], float]:
    """The ``size`` most frequent token ids (ties by id), ``always`` included; and their share of ``counts``."""
    if size < 1:
        raise DSparkError(f"a draft vocabulary needs at least 1 token, got {size}")
    order = np.lexsort((np.arange(counts.size), -counts))  # most frequent first, then lower id
    keep = [int(t) for t in always if 0 <= int(t) < counts.size]
    ids = keep + [int(t) for t in order if int(t) not in set(keep)][: max(0, size - len(keep))]
    total = counts.sum()
    return ids, float(counts[ids].sum() / total) if total else 0.0


def write_draft_vocab(data_dir: str | Path, target, size: int, out: str | Path) -> tuple[list[int], float, np.ndarray]:
    """Count ``data_dir``'s answer tokens and save the ``size`` most frequent (the target's stop tokens always in).

    Returns the ids, their coverage and the counts."""
    counts = count_tokens(data_dir, target.vocab_size)
    ids, coverage = build_draft_vocab(counts, size, sorted(target.eos_token_ids))
    save_draft_vocab(out, ids, target.vocab_size, coverage, str(data_dir))
    return ids, coverage, counts
