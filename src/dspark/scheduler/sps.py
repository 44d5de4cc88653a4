"""The SPS cost table: target steps per second as a function of batch tokens.

The hardware-aware scheduler (paper §3.2.2, Algorithm 1) maximises the
expected token throughput Theta = tau * SPS(B), where B is the number of
tokens the target verifies in one forward pass (each request contributes its
anchor plus its verified drafts). SPS(B) is profiled once at start-up and kept
as a small table.

File format: exactly SGLang's ``dspark_sps.json`` (docs/interop.md §SPS table)::

    {"sample_batch_tokens": [1, 8, 16, ...],   # strictly increasing ints >= 1
     "sample_steps_per_sec": [52.1, 50.3, ...], # one positive float per sample
     "max_batch_tokens": 512}                  # >= the largest sample

Lookup is a floor step: SPS(B) is the value of the largest sample <= B;
below the first sample it is the first value. One deliberate difference from
SGLang, which clamps to the last value: beyond ``max_batch_tokens`` SPS(B) is
0, so a throughput-maximising planner never schedules more tokens than the
engine can run in one step.

Without a profiled table, ``SPSTable.flat()`` ([1] -> 1.0, SGLang's
"uninitialised" table) makes every admission with positive survival raise
Theta, i.e. verify-all.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.errors import BadFileError

#: max_batch_tokens of the flat table: no capacity limit in practice
UNLIMITED_BATCH_TOKENS = 2**31 - 1

_JSON_KEYS = ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens")
_ADDITIVE_KEYS = {"bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds"}


@dataclass(frozen=True)
class SPSTable:
    """Floor-step table of target steps per second against batch tokens."""

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int

    def __post_init__(self) -> None:
        # accept lists, store tuples (the table is hashable and immutable)
        object.__setattr__(self, "sample_batch_tokens", tuple(self.sample_batch_tokens))
        object.__setattr__(self, "sample_steps_per_sec", tuple(self.sample_steps_per_sec))
        tokens, sps = self.sample_batch_tokens, self.sample_steps_per_sec
        if not tokens:
            raise ValueError("SPS table needs at least one sample; use SPSTable.flat() for no table")
        if len(tokens) != len(sps):
            raise ValueError(
                f"sample_batch_tokens and sample_steps_per_sec must have equal length, "
                f"got {len(tokens)} vs {len(sps)}"
            )
        for b in tokens:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"sample_batch_tokens must be integers >= 1, got {list(tokens)}")
        if any(b1 >= b2 for b1, b2 in zip(tokens, tokens[1:])):
            raise ValueError(f"sample_batch_tokens must be strictly increasing, got {list(tokens)}")
        for s in sps:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise ValueError(
                    f"sample_steps_per_sec must be finite positive numbers, got {list(sps)}"
                )
        object.__setattr__(self, "sample_steps_per_sec", tuple(float(s) for s in sps))
        mbt = self.max_batch_tokens
        if isinstance(mbt, bool) or not isinstance(mbt, int) or mbt < tokens[-1]:
            raise ValueError(
                f"max_batch_tokens must be an integer >= the largest sample ({tokens[-1]}), "
                f"got {mbt!r}"
            )

    # ---------------------------------------------------------------- lookup
    def sps(self, batch_tokens: int) -> float:
        """Steps per second at ``batch_tokens`` (floor step; 0 beyond capacity)."""
        if batch_tokens > self.max_batch_tokens:
            return 0.0
        idx = bisect.bisect_right(self.sample_batch_tokens, batch_tokens) - 1
        return self.sample_steps_per_sec[max(idx, 0)]

    def sps_array(self, batch_tokens: np.ndarray) -> np.ndarray:
        """Vectorised ``sps`` in NumPy: int array of any shape -> float64 array of the same shape."""
        probes, values = self._arrays
        b = np.asarray(batch_tokens, dtype=np.int64)
        idx = (np.searchsorted(probes, b, side="right") - 1).clip(min=0)
        return np.where(b > self.max_batch_tokens, 0.0, values[idx])

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(probes int64, values float64), built once."""
        return (np.asarray(self.sample_batch_tokens, dtype=np.int64),
                np.asarray(self.sample_steps_per_sec, dtype=np.float64))

    def sps_tensor(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """``sps_array`` for a tensor: int tensor of any shape -> float64 tensor of the same shape and device."""
        return torch.from_numpy(self.sps_array(batch_tokens.detach().cpu().numpy())).to(batch_tokens.device)

    @property
    def is_flat(self) -> bool:
        """True for a one-sample table: the planner then verifies everything."""
        return len(self.sample_batch_tokens) == 1

    # ------------------------------------------------------------ constructors
    def filled(self) -> SPSTable:
        """Every batch size from the first sample to the last: the samples as they are, the step time linear
        between them (``linear_between``). A profile measured where the cost bends and sparse where it is a line
        then plans like a dense one under the floor-step lookup."""
        grid, times = linear_between(self.sample_batch_tokens, [1.0 / s for s in self.sample_steps_per_sec])
        return SPSTable(grid, tuple(1.0 / t for t in times), self.max_batch_tokens)

    @classmethod
    def flat(cls, max_batch_tokens: int = UNLIMITED_BATCH_TOKENS) -> SPSTable:
        """The no-table fallback [1] -> 1.0 (verify-all), as SGLang's uninitialised table."""
        return cls((1,), (1.0,), max_batch_tokens)

    # --------------------------------------------------------------------- json
    def to_dict(self) -> dict:
        return {
            "sample_batch_tokens": list(self.sample_batch_tokens),
            "sample_steps_per_sec": list(self.sample_steps_per_sec),
            "max_batch_tokens": self.max_batch_tokens,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> SPSTable:
        if not isinstance(data, dict):
            raise ValueError(f"SPS table JSON must be an object, got {type(data).__name__}")
        if _ADDITIVE_KEYS & data.keys():
            raise ValueError(
                "this is SGLang's additive cost-table format (bias_seconds/bs_probes/...), not an SPS table; "
                "`dspark serve --sps-table` reads it as a step-cost model (dspark.scheduler.step_cost), or "
                "profile a floor-step table with `dspark profile`"
            )
        missing = [k for k in _JSON_KEYS if k not in data]
        unknown = sorted(set(data) - set(_JSON_KEYS))
        if missing or unknown:
            raise ValueError(
                f"SPS table JSON must have exactly the keys {list(_JSON_KEYS)}; "
                f"missing {missing}, unknown {unknown}"
            )
        for key in ("sample_batch_tokens", "sample_steps_per_sec"):
            if not isinstance(data[key], list):
                raise ValueError(f"SPS table key {key!r} must be a list, got {data[key]!r}")
        return cls(data["sample_batch_tokens"], data["sample_steps_per_sec"], data["max_batch_tokens"])

    @classmethod
    def from_json(cls, text: str) -> SPSTable:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"SPS table is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> SPSTable:
        """Read and validate ``path``; raises ``BadFileError`` (one line naming the file) if it is bad."""
        path = Path(path)
        if not path.is_file():
            raise BadFileError(f"SPS table file {path} does not exist; profile one with `dspark profile`")
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # ValueError: malformed table, or not UTF-8
            raise BadFileError(f"SPS table file {path}: {e}") from None


def linear_between(grid: Iterable[int], values: Iterable[float]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Every integer from ``grid[0]`` to ``grid[-1]``, each value linear between its measured neighbours.

    ``grid`` strictly increasing; the grid's own points keep their values exactly.
    """
    xs, ys = list(grid), [float(v) for v in values]
    if not xs or len(xs) != len(ys) or any(a >= b for a, b in zip(xs, xs[1:])):
        raise ValueError(f"need a strictly increasing grid with one value per point, got {xs} and {ys}")
    dense = np.arange(xs[0], xs[-1] + 1)  # (G,)
    filled = np.interp(dense, xs, ys)  # (G,)
    filled[np.searchsorted(dense, xs)] = ys  # bitwise the measured values at measured points
    return tuple(int(x) for x in dense), tuple(float(y) for y in filled)


def profile_sps(
    step_fn: Callable[[int], object],
    batch_token_grid: Iterable[int],
    repeats: int = 5,
    warmup: int = 1,
    max_batch_tokens: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> SPSTable:
    """Time ``step_fn(batch_tokens)`` on each grid point and build the table.

    ``step_fn`` runs one target step over ``batch_tokens`` tokens and must
    return only when the work is done (on a GPU: synchronise inside it).
    Each grid point gets ``warmup`` untimed calls and ``repeats`` timed ones;
    steps_per_sec = 1 / median step time (SGLang's convention).
    ``max_batch_tokens`` defaults to the largest grid point. ``clock`` is
    injectable for tests.
    """
    grid = sorted(int(b) for b in batch_token_grid)
    if not grid:
        raise ValueError("batch_token_grid is empty; pass the batch sizes (in tokens) to profile")
    if grid[0] < 1:
        raise ValueError(f"batch_token_grid entries must be >= 1, got {grid[0]}")
    if len(set(grid)) != len(grid):
        raise ValueError(f"batch_token_grid has duplicates: {grid}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    steps_per_sec = []
    for b in grid:
        for _ in range(warmup):
            step_fn(b)
        times = []
        for _ in range(repeats):
            start = clock()
            step_fn(b)
            times.append(clock() - start)
        median = statistics.median(times)
        if median <= 0:
            raise ValueError(f"median step time at {b} batch tokens is {median} s; the clock is too coarse")
        steps_per_sec.append(1.0 / median)
    capacity = grid[-1] if max_batch_tokens is None else max_batch_tokens
    return SPSTable(tuple(grid), tuple(steps_per_sec), capacity)
