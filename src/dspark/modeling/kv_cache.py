"""KV caches preallocated in one tensor and indexed by position (gpt-fast / vLLM style).

A ``KVPool`` holds the keys and values of many requests in one tensor, one **slot** per request; a
``KVCache`` is a request's handle on its slot: a length and a view. Rolling back after a rejection is
resetting ``length``. Because every request of a batch lives in the same tensor, the decoder attends for
the whole flattened batch with one call per layer (``dspark.modeling.attention``).

The pool grows instead of failing: capacity (positions per slot) by doubling when a request outgrows it,
slots by doubling when all are taken, so appends and admissions are amortised O(1). A slot returns to the
pool when its handle is released or garbage-collected. Capacities are kept multiples of ``BLOCK`` so that
attention can read whole key blocks (``dspark.modeling.attention``).

A ``KVCache`` built directly (the drafters' private caches) gets a pool of its own with one slot.

Shapes: Ly = layers, P = slots, Hkv = KV heads, C = capacity, D = head dim.
"""

from __future__ import annotations

import torch

#: positions per key block: capacities are multiples of it (the attention pads key lengths to it)
BLOCK = 64


def _round_up(n: int, block: int = BLOCK) -> int:
    return -(-n // block) * block


class KVPool:
    """Keys and values of up to ``slots`` requests (more on demand) in one preallocated tensor."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, slots: int = 1, capacity: int = 256,
        dtype: torch.dtype = torch.float32, max_length: int | None = None, device: torch.device | str | None = None,
    ) -> None:
        self.max_length = max_length
        capacity = _round_up(max(capacity, 1))
        shape = (num_layers, max(slots, 1), num_kv_heads, capacity, head_dim)
        # zeros, not empty: attention multiplies masked positions by 0, which must stay 0 (never 0 * NaN)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (Ly, P, Hkv, C, D)
        self.values = torch.zeros_like(self.keys)  # (Ly, P, Hkv, C, D)
        self._free = set(range(shape[1]))  # allocate takes the lowest: active slots stay dense

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one cached position takes (all layers)."""
        ly, _, hkv, _, d = self.keys.shape
        return 2 * ly * hkv * d * self.keys.element_size()

    def allocate(self, capacity: int = 0, max_length: int | None = None) -> "KVCache":
        """A handle on a free slot with room for at least ``capacity`` positions."""
        if not self._free:
            self._grow(slots=2 * self.num_slots)
        slot = min(self._free)
        self._free.discard(slot)
        cache = KVCache._on_slot(self, slot, max_length if max_length is not None else self.max_length)
        if capacity > self.capacity:
            self.ensure_capacity(capacity)
        return cache

    def release(self, slot: int) -> None:
        self._free.add(slot)  # one set operation: safe from a finaliser on any thread

    def ensure_capacity(self, need: int) -> None:
        """Make every slot hold at least ``need`` positions (doubling, capped at ``max_length``)."""
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        if self.max_length is not None:
            new_cap = max(min(new_cap, self.max_length), need)
        self._grow(capacity=_round_up(new_cap))

    def reserve(self, slots: int, capacity: int) -> None:
        """Hold at least ``slots`` slots of ``capacity`` positions (capped at ``max_length``) now, in one copy at
        most: a server sizes its pool for its batch at start-up instead of doubling under load."""
        if self.max_length is not None:
            capacity = min(capacity, self.max_length)
        new_p, new_c = max(slots, self.num_slots), max(_round_up(max(capacity, 1)), self.capacity)
        if (new_p, new_c) != (self.num_slots, self.capacity):
            self._grow(slots=new_p, capacity=new_c)

    def _grow(self, slots: int | None = None, capacity: int | None = None) -> None:
        ly, p, hkv, c, d = self.keys.shape
        new_p, new_c = slots or p, capacity or c
        keys = self.keys.new_zeros(ly, new_p, hkv, new_c, d)
        values = torch.zeros_like(keys)
        keys[:, :p, :, :c] = self.keys
        values[:, :p, :, :c] = self.values
        self.keys, self.values = keys, values
        self._free |= set(range(p, new_p))


class KVCache:
    """One request's cache: a slot of a ``KVPool`` and how many positions of it are filled."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int,
        capacity: int = 256, dtype: torch.dtype = torch.float32, max_length: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if max_length is not None:
            capacity = min(capacity, max_length)
        pool = KVPool(num_layers, num_kv_heads, head_dim, 1, capacity, dtype, max_length, device)
        self._attach(pool, pool._free.pop(), max_length)  # its only slot

    @classmethod
    def _on_slot(cls, pool: KVPool, slot: int, max_length: int | None) -> "KVCache":
        cache = cls.__new__(cls)
        cache._attach(pool, slot, max_length)
        return cache

    def _attach(self, pool: KVPool, slot: int, max_length: int | None) -> None:
        self.pool = pool
        self.slot: int | None = slot
        self.length = 0
        self.max_length = max_length

    @property
    def keys(self) -> torch.Tensor:  # (Ly, Hkv, C, D), a view into the pool
        return self.pool.keys[:, self.slot]

    @property
    def values(self) -> torch.Tensor:  # (Ly, Hkv, C, D)
        return self.pool.values[:, self.slot]

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more positions."""
        need = self.length + extra
        if self.max_length is not None and need > self.max_length:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_length}")
        self.pool.ensure_capacity(need)

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        self.length = length

    def release(self) -> None:
        """Give the slot back to the pool (idempotent); the handle is unusable afterwards."""
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None

    def __del__(self) -> None:
        slot = getattr(self, "slot", None)
        if slot is not None:
            self.pool.release(slot)
