"""Context features grown in place: one preallocated buffer per request, appended to, never re-concatenated.

A drafter that reads target features (DSpark, DFlash, Eagle3) sees ``RequestState.context_features``, a
(n_fed, F) tensor of every fed, committed position. Appending with ``torch.cat`` copies the whole history at
every step (O(n^2) bytes over a request); here the first append allocates room for the prompt, every token
the request may still commit, and later appends write into that room. The tensor a
drafter sees is a view of the buffer's first n_fed rows.

Whoever replaces ``context_features`` by hand (a profiler rewinding a step, a test) is followed: when the
tensor is not a prefix view of the request's buffer, the next append starts a new buffer from it.

Shapes: n = positions appended now, F = target-feature width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.drafters.base import RequestState


@dataclass
class FeatureBuffer:
    """Room for a request's context features; rows [0, length) are filled."""

    data: torch.Tensor  # (capacity, F)
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    def holds(self, view: torch.Tensor) -> bool:
        """Whether ``view`` is rows [0, view.shape[0]) of this buffer (so appending after it is safe)."""
        return (view.dim() == 2 and view.shape[1] == self.data.shape[1] and view.dtype == self.data.dtype
                and view.device == self.data.device and view.shape[0] <= self.length
                and view.data_ptr() == self.data.data_ptr() and view.stride() == self.data.stride())


def append_context_features(req: RequestState, piece: torch.Tensor) -> None:
    """Append ``piece`` (n, F) to ``req.context_features`` in place.

    The buffer holds a row for every token the request may commit (prompt + max_new_tokens); a request that outgrows it (or whose features
    were replaced) gets a new one of twice the size, so appends stay amortised O(n).
    """
    current = req.context_features
    buf = req.feature_buffer
    if current is None:
        have = 0
    elif isinstance(buf, FeatureBuffer) and buf.holds(current):
        have = buf.length = current.shape[0]  # a rewound view: later rows are free again
    else:
        have, buf = current.shape[0], None  # features set from elsewhere: copy them into a new buffer
    need = have + piece.shape[0]
    if buf is None or need > buf.capacity or buf.data.dtype != piece.dtype or buf.data.device != piece.device:
        room = len(req.tokens) + req.sampling.max_new_tokens
        capacity = max(need, room, 2 * buf.capacity if buf is not None else 0)
        fresh = FeatureBuffer(torch.empty(capacity, piece.shape[1], dtype=piece.dtype, device=piece.device))
        if have:
            fresh.data[:have] = current
        buf = fresh
        req.feature_buffer = buf
    buf.data[have:need] = piece
    buf.length = need
    req.context_features = buf.data[:need]  # (n_fed, F)
