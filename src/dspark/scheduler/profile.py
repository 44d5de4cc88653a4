"""Profile the SPS table of a real target: steps per second against batch tokens.

One profiled "step" is what a serving verify pass costs: ``target.forward``
over a flattened batch of R requests x (gamma + 1) tokens (anchor + gamma
drafts), logits for every position, against warm KV caches that already hold
``context_len`` tokens each; the caches are rolled back after every call so
the context length stays fixed. The batch sizes timed (``batch_token_grid``) are every
count up to gamma + 1, one request verifying 0..gamma drafts (on a CPU such a pass reads the weights once and
costs about what one token does, not even monotonically:
docs/serving/step-cost.md §What the profile times, and how the planner reads it),
then SGLang's points R x (gamma + 1) (docs/interop.md §SPS table) at R = 2, 3, 4, 6, 8, 12, ... and
``max_requests``, where the cost grows about linearly in B; the table holds every count from 1 to the largest,
the step time linear between the timed ones (``SPSTable.filled``), so the floor-step lookup sees the slope between
SGLang's samples. ``dense`` times every count instead, at the price of a longer profile.

Shapes: N = tokens in a profiled batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dspark.scheduler.sps import SPSTable, profile_sps
from dspark.target.model import TargetModel


def model_device(target: TargetModel) -> torch.device:
    return next(target.model.parameters()).device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_token_grid(block_size: int, max_requests: int, dense: bool = False) -> list[int]:
    """Batch sizes (in tokens) to time: every count up to gamma + 1 (one request verifying 0..gamma drafts, where a
    CPU pass costs about the same and not even monotonically), then R * (gamma + 1) for R = 2, 3, 4, 6, 8, 12, ...
    and ``max_requests`` (where the cost grows about linearly: ``SPSTable.filled`` draws the line between).
    ``dense``: every count up to max_requests * (gamma + 1)."""
    if block_size < 0 or max_requests < 1:
        raise ValueError(f"need block_size >= 0 and max_requests >= 1, got {block_size}, {max_requests}")
    window = block_size + 1
    if dense:
        return list(range(1, max_requests * window + 1))
    requests = {max_requests} | {r for r in range(2, max_requests + 1) if _is_grid_count(r)}
    return sorted(set(range(1, window + 1)) | {r * window for r in requests})


def _is_grid_count(r: int) -> bool:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ...: powers of two and 1.5 times them."""
    return r & (r - 1) == 0 or (r % 3 == 0 and (r // 3) & (r // 3 - 1) == 0)


def profile_target(
    target: TargetModel,
    block_size: int = 7,
    max_requests: int = 16,
    context_len: int = 256,
    repeats: int = 5,
    warmup: int = 1,
    capture_layers: list[int] | None = None,  # the drafter's target_layer_ids: verify passes capture them
    dense: bool = False,
    seed: int = 0,
    prefill: bool = False,
) -> SPSTable:
    """Time verify passes of ``target`` and return the SPS table (1 / median step time per grid point).

    ``prefill``: time prefill passes instead, as the engine runs them: ONE request's chunk of B tokens after
    ``context_len`` cached ones (0 = a first chunk), logits for its last token only; B on the same grid.
    """
    window = block_size + 1
    if context_len < (0 if prefill else 1):
        raise ValueError(f"context_len must be >= {0 if prefill else 1}, got {context_len}")
    grid = batch_token_grid(block_size, max_requests, dense)
    longest = grid[-1] if prefill else window
    if context_len + longest > target.max_context:
        raise ValueError(
            f"context_len {context_len} + {longest} {'prefill' if prefill else 'verify'} tokens exceeds the model's "
            f"context of {target.max_context}; profile with a shorter --context-len"
        )
    device = model_device(target)
    gen = torch.Generator().manual_seed(seed)
    V = target.vocab_size
    if prefill:
        return _profile_prefill(target, grid, context_len, repeats, warmup, capture_layers, gen)

    # warm caches: max_requests random contexts, prefilled a few requests at a time
    caches = [target.new_cache(context_len + window + 1) for _ in range(max_requests)]
    chunk = max(1, 4096 // context_len)
    for start in range(0, max_requests, chunk):
        part = caches[start : start + chunk]
        ids = torch.randint(V, (len(part) * context_len,), generator=gen).to(device)  # (N,)
        target.forward(ids, [context_len] * len(part), part, None, logits_for="none", prompt_from=0)
    pool = torch.randint(V, (grid[-1],), generator=gen).to(device)  # (N_max,) verify-token ids

    def step(batch_tokens: int) -> None:
        num_requests = math.ceil(batch_tokens / window)
        seq_lens = [window] * (num_requests - 1) + [batch_tokens - window * (num_requests - 1)]
        used = caches[:num_requests]
        target.forward(pool[:batch_tokens], seq_lens, used, capture_layers, logits_for="all")
        synchronize(device)
        for cache in used:
            cache.truncate(context_len)

    return profile_sps(step, grid, repeats=repeats, warmup=warmup).filled()


def _profile_prefill(target: TargetModel, grid: list[int], context_len: int, repeats: int, warmup: int,
                     capture_layers: list[int] | None, gen: torch.Generator) -> SPSTable:
    """Prefill passes of one request: B new tokens after ``context_len`` cached ones, last-token logits."""
    device = model_device(target)
    cache = target.new_cache(context_len + grid[-1] + 1)
    if context_len:
        ids = torch.randint(target.vocab_size, (context_len,), generator=gen).to(device)  # (context_len,)
        target.forward(ids, [context_len], [cache], None, logits_for="none", prompt_from=0)
    pool = torch.randint(target.vocab_size, (grid[-1],), generator=gen).to(device)  # (B_max,) prompt-token ids

    def step(batch_tokens: int) -> None:
        target.forward(pool[:batch_tokens], [batch_tokens], [cache], capture_layers, logits_for="last", prompt_from=0)
        synchronize(device)
        cache.truncate(context_len)

    return profile_sps(step, grid, repeats=repeats, warmup=warmup).filled()


def load_or_profile(
    path: str | Path | None,
    target: TargetModel,
    block_size: int,
    max_requests: int,
    capture_layers: list[int] | None = None,
    context_len: int = 128,
    repeats: int = 3,
    log=print,
) -> SPSTable:
    """The table in ``path`` if given, else a quick profile (fewer repeats, shorter context)."""
    if path is not None:
        return SPSTable.load(path)
    log(f"[dspark] no --sps-table: profiling {max_requests} requests x {block_size + 1} tokens "
        f"at context {context_len} (save one with `dspark profile`)")
    context_len = max(1, min(context_len, target.max_context - block_size - 2))
    return profile_target(target, block_size, max_requests, context_len, repeats=repeats, warmup=1,
                          capture_layers=capture_layers)
