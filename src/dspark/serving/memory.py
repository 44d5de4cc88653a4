"""Allocator and kernel-cache settings that lower a long-running server's resident memory.

Every request allocates tensors of its own sizes (a KV cache sized to its prompt and budget, prefill
activations, draft blocks) from several threads (the engine, uvicorn's loop, the tokenising workers).
With glibc's defaults a freed block of a few MB raises the mmap threshold to its size, so later blocks
of that size come from per-thread heaps (arenas) that fragment and are seldom returned to the system:
RSS can rise in steps with the mix of request sizes and not come back.

The growers are the kernel caches of bf16 matmuls on CPU. A server sees a new row count with almost
every new prompt length and batch, and each new (rows, weight) shape compiles new kernels that stay:

- oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1,024 by default): capped at 256, about 0.3
  MiB of heap per primitive, so at most about 80 MiB however many row counts come (``scripts/native_growth.py``;
  at 1,024 the heap grew by 361 MiB over 160 row counts). Not lower: a drafting step alone runs a dozen matmul
  shapes (the drafter's and the target's, each at its own row count), which a cache of 16 recompiled every step
  (DSpark's proposal 5.8 ms instead of 3.6 at one client under ``fixed:1``, docs/serving/README.md);
- ideep's LRU cache of computations in front of it (``LRU_CACHE_CAPACITY``, 1,024 by default), which
  the prepacked linears (``dspark.modeling.packed``) go through: about 1.6 MiB of heap per new row
  count, so 160 distinct prompt lengths grew the heap in use by 254 MiB and it never came back
  (``scripts/native_growth.py``); capped at 64 entries it stays flat, at no measurable cost in speed.

``tune_malloc`` caps the number of arenas (and fixes the mmap/trim thresholds only when asked: fixed
low they cost half the server's throughput, see ``tune_malloc``); ``Trimmer`` returns free heap pages to
the system (malloc_trim) every ``every`` finished requests, in a worker thread. Both are no-ops where the C library is not glibc, and
an allocator setting given in the environment (MALLOC_ARENA_MAX, ...) is left as it is.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading

log = logging.getLogger("dspark.serving")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # <malloc.h>
ENV = {M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_", M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_",
       M_ARENA_MAX: "MALLOC_ARENA_MAX"}


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def tune_malloc(arena_max: int = 2, mmap_threshold: int | None = None, trim_threshold: int | None = None) -> dict:
    """At most ``arena_max`` arenas, and fixed mmap/trim thresholds where given; returns the settings applied
    (empty: none).

    The thresholds stay glibc's dynamic ones by default: fixed at 256 KiB / 512 KiB (the earlier default) every
    activation of a prefill chunk or a batch of 16 was mmapped, page-faulted in and unmapped again, and the
    server made 0.45x the tokens/s at 16 clients (scripts/malloc_serving.sh, docs/serving/malloc.md)."""
    libc = _glibc()
    if libc is None:
        return {}
    applied = {}
    for param, value in ((M_ARENA_MAX, arena_max), (M_MMAP_THRESHOLD, mmap_threshold),
                         (M_TRIM_THRESHOLD, trim_threshold)):
        if value is None:
            continue
        if os.environ.get(ENV[param]) is None and libc.mallopt(param, value) == 1:
            applied[ENV[param]] = value
    return applied


ONEDNN_CACHE_CAPACITY = 256  # oneDNN's default is 1024
IDEEP_CACHE_CAPACITY = 64  # ideep's default is 1024


def cap_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY, ideep_capacity: int = IDEEP_CACHE_CAPACITY) -> dict:
    """Cap oneDNN's primitive cache and ideep's computation cache (both read at their first use, so call
    this before the first matmul); a capacity given in the environment wins. Returns the capacities in force."""
    return {name: int(os.environ.setdefault(name, str(value)))
            for name, value in (("ONEDNN_PRIMITIVE_CACHE_CAPACITY", capacity), ("LRU_CACHE_CAPACITY", ideep_capacity))}


def freeze_startup_objects() -> int:
    """Move every object alive now (the modules of torch, transformers, the model) out of the garbage
    collector's reach: a full collection then scans only what requests allocate. Over the start-up heap a
    full collection took 0.1-0.3 s (scripts/soak_probe.py, during loading), all of it with the GIL held.
    Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Trimmer:
    """Call ``done()`` per finished request; every ``every`` of them malloc_trim(0) runs in a worker thread."""

    def __init__(self, every: int = 64) -> None:
        self.every = every
        self._libc = _glibc()
        self._count = 0
        self._running = threading.Lock()

    def done(self) -> None:
        if self._libc is None or self.every <= 0:
            return
        self._count += 1
        if self._count % self.every == 0 and self._running.acquire(blocking=False):
            threading.Thread(target=self._trim, name="dspark-malloc-trim", daemon=True).start()

    def _trim(self) -> None:
        try:
            self._libc.malloc_trim(0)
        finally:
            self._running.release()
