"""Draft vocabulary: the tokens a drafter may propose (``--draft-vocab``), Eagle3's reduced draft vocab idea.

A DSpark/DFlash drafter shares the target's LM head, so its base logits U_k cost a
(K x H) @ (H x V) product per step; for a 135M target with V = 49,152 that is most
of the drafter's time. Restricting drafts to the N tokens the target actually
generates most often (counted over the assistant tokens of a tokenized training
set) computes U_k on those N rows only. Every other token gets probability 0 in
the draft, which the rejection sampler handles like any other draft distribution:
decoding stays lossless, only tokens outside the set can never be drafted.

This module holds the file format (`save_draft_vocab`, `load_draft_vocab`); counting a tokenized
training set and choosing the tokens is `dspark.data.vocab` (`dspark data vocab`).

File: JSON {"format": "dspark-draft-vocab", "version": 1, "token_ids": [...] (most
frequent first), "vocab_size": V, "coverage": share of counted tokens inside, ...}.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.errors import BadFileError

FORMAT = "dspark-draft-vocab"


def save_draft_vocab(path: str | Path, ids: list[int], vocab_size: int, coverage: float, source: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "version": 1, "vocab_size": vocab_size, "size": len(ids),
                                "coverage": round(coverage, 6), "source": source, "token_ids": ids}) + "\n",
                    encoding="utf-8")
    return path


def load_draft_vocab(path: str | Path, vocab_size: int) -> list[int]:
    """The token ids of a draft-vocabulary file; ``BadFileError`` (one line naming the file) if it is bad."""

    def bad(what: str) -> BadFileError:
        return BadFileError(f"--draft-vocab {path}: {what}")

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise bad(f"cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} file (write one with `dspark data vocab`)")
    if data.get("vocab_size") != vocab_size:
        raise BadFileError(f"--draft-vocab {path} was built for a vocabulary of {data.get('vocab_size')} tokens, "
                           f"the target has {vocab_size}")
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("'token_ids' must be a list of integer token ids")
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise bad(f"token_ids must be distinct ids in [0, {vocab_size})")
    return ids
