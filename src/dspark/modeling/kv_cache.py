"""Per-request KV cache, preallocated and indexed by position (gpt-fast style).

Rolling back after a rejection is resetting ``length``; the storage grows by
doubling when a request outgrows it, so appends are amortised O(1).

Shapes: Ly = layers, Hkv = KV heads, C = capacity, D = head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int,
        capacity: int = 256, dtype: torch.dtype = torch.float32, max_length: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if max_length is not None:
            capacity = min(capacity, max_length)
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (Ly, Hkv, C, D)
        self.values = torch.zeros_like(self.keys)  # (Ly, Hkv, C, D)
        self.length = 0
        self.max_length = max_length

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more positions."""
        need = self.length + extra
        if self.max_length is not None and need > self.max_length:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_length}")
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        if self.max_length is not None:
            new_cap = min(new_cap, self.max_length)
        grow = new_cap - self.capacity
        pad = self.keys.new_zeros(*self.keys.shape[:2], grow, self.keys.shape[3])
        self.keys = torch.cat([self.keys, pad], dim=2)
        self.values = torch.cat([self.values, pad.clone()], dim=2)

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        self.length = length
