"""Decontamination: keep prompts disjoint from the evaluation sets, from each other and across splits.

A prompt is dropped when it matches, contains or lies inside a first turn of any evaluation set
(`EvalIndex`), when too many of its word 8-grams occur in those turns, when it repeats an earlier
prompt, or when its source item belongs to the other split: one item in ten (by a hash of its
source key, `is_reserved`) is reserved for the evaluation substitute (`dspark.data.substitute`) and
never used for training, so the substitute is disjoint from the training prompts whatever the seed
or size.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dspark.data.eval_sets import read_first_turns
from dspark.data.prompt_sources import MATH_SUFFIX
from dspark.errors import DSparkError

RESERVE_MOD = 10  # one source item in RESERVE_MOD is kept for the evaluation substitute


def normalise(text: str) -> str:
    """Lowercase with whitespace collapsed: the form in which prompts are compared."""
    return " ".join(text.replace("\x00", " ").lower().split())


_NORM_SUFFIX = normalise(MATH_SUFFIX)


def _ngrams(norm_text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"[^\W\d_]+|\d+(?:\.\d+)?", norm_text.replace(_NORM_SUFFIX, " "))
    words = ["#" if w[0].isdigit() else w for w in words]  # numbers vary between template copies
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class EvalIndex:
    """First turns of every evaluation JSONL in a folder, for disjointness checks.

    A prompt *matches* when its normalised text equals an evaluation first turn, contains one, or is
    contained in one; containment counts only when the shorter text has at least
    `min_containment_chars` characters (otherwise "hello" would match half of the chat sets).
    `overlap` is the share of a prompt's word 8-grams (numbers masked, math suffix removed) that
    occur in any evaluation first turn: it catches template copies with changed names and numbers.
    """

    def __init__(self, first_turns: Iterable[str], min_containment_chars: int = 20, ngram: int = 8):
        turns = {normalise(t) for t in first_turns}
        # the question without the math suffix counts too: a prompt may quote just the question
        self.turns = (turns | {t.replace(_NORM_SUFFIX, "").strip() for t in turns}) - {""}
        self.min_chars = min_containment_chars
        self.ngram = ngram
        self._joined = "\x00".join(sorted(self.turns))
        self._short = [t for t in self.turns if min_containment_chars <= len(t) < 2 * min_containment_chars]
        self._by_head: dict[str, list[str]] = {}
        for t in self.turns:
            if len(t) >= 2 * min_containment_chars:
                self._by_head.setdefault(t[: 2 * min_containment_chars], []).append(t)
        self._grams = set().union(*(_ngrams(t, ngram) for t in self.turns)) if self.turns else set()

    @classmethod
    def from_dir(cls, eval_dir: str | Path, **kwargs) -> "EvalIndex":
        """The first turns of every ``*.jsonl`` in ``eval_dir``, read like the evaluation sets."""
        eval_dir = Path(eval_dir)
        files = sorted(eval_dir.glob("*.jsonl"))
        if not files:
            raise DSparkError(f"{eval_dir} holds no *.jsonl evaluation files; pass the right --eval-dir")
        return cls([turn for path in files for turn in read_first_turns(path)], **kwargs)

    def matches(self, norm_text: str) -> bool:
        if norm_text in self.turns:
            return True
        if len(norm_text) >= self.min_chars and self._may_lie_inside(norm_text) and norm_text in self._joined:
            return True  # the prompt lies inside an evaluation turn
        if any(t in norm_text for t in self._short):
            return True
        width = 2 * self.min_chars
        for i in range(len(norm_text) - width + 1):  # an evaluation turn lies inside the prompt
            for turn in self._by_head.get(norm_text[i:i + width], ()):
                if norm_text.startswith(turn, i):
                    return True
        return False

    def _may_lie_inside(self, norm_text: str) -> bool:
        """Cheap necessary test before a substring search through all turns (milliseconds each):
        text inside a turn shares all its word n-grams with it, save at most one cut word per end."""
        grams = _ngrams(norm_text, self.ngram)
        return len(grams - self._grams) <= 2

    def overlap(self, norm_text: str) -> float:
        grams = _ngrams(norm_text, self.ngram)
        return len(grams & self._grams) / len(grams) if grams else 0.0


def is_reserved(key: str) -> bool:
    """Whether a source item is kept for the evaluation substitute (one in RESERVE_MOD)."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) % RESERVE_MOD == 0


@dataclass
class PromptFilter:
    """Drops duplicates, evaluation matches and (by `reserved`) items of the other split."""

    eval_index: EvalIndex
    keep_reserved: bool  # False: training prompts; True: the evaluation substitute
    max_eval_overlap: float | None = 0.5
    max_chars: int = 6000
    seen: set[str] = field(default_factory=set)
    excluded: set[str] = field(default_factory=set)
    dropped: Counter = field(default_factory=Counter)

    def exclude(self, texts: Iterable[str]) -> None:
        """Never accept these prompts (an earlier prompt set's): dropped as "excluded"."""
        self.excluded.update(normalise(t) for t in texts)

    def accept(self, key: str, text: str) -> bool:
        norm = normalise(text)
        if is_reserved(key) != self.keep_reserved:
            reason = "other_split"
        elif not norm or len(text) > self.max_chars:
            reason = "length"
        elif norm in self.excluded:
            reason = "excluded"
        elif norm in self.seen:
            reason = "duplicate"
        elif self.eval_index.matches(norm):
            reason = "eval_match"
        elif self.max_eval_overlap is not None and self.eval_index.overlap(norm) > self.max_eval_overlap:
            reason = "eval_overlap"
        else:
            self.seen.add(norm)
            return True
        self.dropped[reason] += 1
        return False
