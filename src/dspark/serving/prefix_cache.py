"""Prompt prefixes kept after their requests finish, so that a new prompt that starts the same way skips their prefill.

A finished request leaves its KV-cache slot (and its target features, for drafters that read them) to the
``PrefixCache`` instead of the pool: rows [0, n) of the slot hold the keys and values of its first n prompt tokens,
whatever it generated after them. A new request whose prompt shares the first L tokens with a kept prompt gets those
L positions copied into its own slot (one copy per layer, far cheaper than the prefill it replaces) and prefills
only the rest. At least one prompt token is always fed, for the logits of the first generated token. vLLM caches
prefixes by default (automatic prefix caching); this is its simplest form: whole kept prompts, least recently used
evicted, no block sharing.

Exactness: the copied keys, values and features are the ones the target computed for the same tokens at the same
positions, so decoding stays the target's (greedy: its greedy text). Bitwise, a cached prefix equals a fresh prefill
when both cut the prompt alike: ``align`` (the engine passes ``prefill_chunk`` in its batch-invariant mode, where
every prompt is fed in pieces cut at multiples of it) rounds the reused length down to such a cut.

Shapes: n = kept prompt tokens, F = target-feature width.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from dspark.modeling.kv_cache import KVCache


@dataclass
class PrefixEntry:
    tokens: list[int]  # the kept prompt, [0, n)
    cache: KVCache  # rows [0, n) hold its keys and values
    features: torch.Tensor | None  # (n, F) its target features, None when the drafter reads none


@dataclass(frozen=True)
class PrefixHit:
    length: int  # prompt tokens restored
    features: torch.Tensor | None  # (length, F) or None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case for a repeated prompt: one C-level comparison
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality, O(n log n) in C
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """At most ``max_entries`` kept prompts (0: none), least recently used first out."""

    def __init__(self, max_entries: int, min_tokens: int = 16, align: int = 1) -> None:
        if max_entries < 0 or min_tokens < 1 or align < 1:
            raise ValueError(f"max_entries >= 0, min_tokens >= 1 and align >= 1, got {max_entries}, {min_tokens}, "
                             f"{align}")
        self.max_entries = max_entries
        self.min_tokens = max(min_tokens, align)  # shorter reuses are not worth a lookup and a copy
        self.align = align
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # by id, oldest use first
        self._ids = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, prompt: list[int], cache: KVCache, features: torch.Tensor | None) -> bool:
        """Keep ``cache``'s slot for the first ``cache.length`` tokens of ``prompt`` (the caller stops using it).
        Returns False, releasing the slot, when the cache is off or there is too little to keep."""
        n = min(len(prompt), cache.length)
        if self.max_entries == 0 or n < self.min_tokens or (features is not None and features.shape[0] < n):
            cache.release()
            return False
        for key, entry in self._entries.items():  # already kept as (a prefix of) a longer kept prompt
            if len(entry.tokens) >= n and entry.tokens[:n] == prompt[:n] and (entry.features is not None
                                                                                or features is None):
                self._entries.move_to_end(key)
                cache.release()
                return False
        for key, entry in list(self._entries.items()):  # a kept prompt this one extends is redundant
            if len(entry.tokens) <= n and entry.tokens == prompt[: len(entry.tokens)]:
                self._drop(key)
        while len(self._entries) >= self.max_entries:
            self._drop(next(iter(self._entries)))
        self._ids += 1
        kept = None if features is None else features[:n].clone()  # the request's buffer has room for all it generates
        self._entries[self._ids] = PrefixEntry(list(prompt[:n]), cache, kept)
        return True

    def restore(self, prompt: list[int], cache: KVCache, want_features: bool) -> PrefixHit | None:
        """Copy the longest kept prefix of ``prompt`` into the empty ``cache`` (its length set); None when no kept
        prompt shares at least ``min_tokens`` tokens (after aligning) or has the features asked for."""
        best, best_len = None, 0
        for key, entry in self._entries.items():
            if want_features and entry.features is None:
                continue
            n = common_prefix(entry.tokens, prompt)
            if n > best_len:
                best, best_len = key, n
        length = min(best_len, len(prompt) - 1) // self.align * self.align  # one prompt token is always fed
        if best is None or length < self.min_tokens:
            return None
        entry = self._entries[best]
        self._entries.move_to_end(best)
        cache.reserve(length)
        src, dst = entry.cache, cache
        dst.pool.keys[:, dst.slot, :, :length] = src.pool.keys[:, src.slot, :, :length]
        dst.pool.values[:, dst.slot, :, :length] = src.pool.values[:, src.slot, :, :length]
        dst.length = length
        return PrefixHit(length, None if entry.features is None or not want_features else entry.features[:length])

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        self._entries.pop(key).cache.release()
