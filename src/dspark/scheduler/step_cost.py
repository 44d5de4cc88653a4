"""The step-cost model: what one whole engine step costs, the quantity the verify schedulers plan on.

Algorithm 1 and its async variant (paper §3.2.2, §5.2) pick the plan that maximises expected tokens per
second. The paper writes Theta = tau * SPS(B), with SPS(B) the target's verify passes per second at B
batch tokens. That is the throughput of the engine only when the verify pass is the whole step. A serving
step also drafts (a cost that grows with the number of drafting requests, not with B) and does host work
per request (sampling, rejection sampling, commits). With those added, the throughput of a plan is

    Theta = tau / (draft_ms(R_d) + verify_ms(B) + host_ms(R)) * 1000    [tokens per second]

with R requests in the step, R_d of them drafting (those that proposed at least one token), B = sum_r
(1 + l_r) batch tokens and tau = sum_r (1 + sum_{j <= l_r} a_{r,j}) expected committed tokens. This is
the objective of vLLM's adaptive verification (drafter_ms by requests, forward_ms by target tokens) and of
SGLang's additive table (docs/interop.md §SPS table), plus the per-request host term. A cost that does not
depend on the plan still moves the optimum: the larger the fixed part of a step, the cheaper one more
verified token is relatively, so the planner verifies longer.

File format (``dspark profile --step-cost FILE`` writes it; docs/serving/step-cost.md)::

    {"format": "dspark-step-cost", "version": 1, "units": "ms",
     "verify": {"batch_tokens": [8, 16, ...], "ms": [20.1, 24.3, ...], "max_batch_tokens": 128},
     "draft":  {"requests": [1, 2, ...], "ms": [3.0, 3.4, ...]},
     "host":   {"requests": [1, 2, ...], "ms": [1.1, 1.9, ...]},
     "host_greedy": {"requests": [1, 2, ...], "ms": [0.4, 0.6, ...]},   # optional: all requests greedy
     "profile": {"target": "smollm2-135m", "drafter": "prompt-lookup", "dtype": "bfloat16",
                 "device": "cpu", "threads": 1, "block_size": 7, "context_len": 256, "repeats": 5}}

Host work depends on the batch's sampling: greedy requests compare tokens, sampled ones build and sample
distributions over the vocabulary (several times the work). ``host`` is timed with sampled requests, the optional
``host_greedy`` with greedy ones on the same grid; a planner prices a batch with the share of greedy requests it holds
(``for_batch``). Every curve is a floor step over its grid (the value of the largest sample <= x; below the first sample
the first value; beyond the last sample the last value), like the SPS table's lookup. Verify grids are
strictly increasing integers >= 1 with positive times; draft and host times may be 0. Beyond
``max_batch_tokens`` a step cannot run (infinite cost, throughput 0), as with the SPS table. The
``profile`` object says what was measured; all its keys are optional, unknown ones are errors.

Conversions: a plain SPS table is a model with zero draft and host cost (verify_ms = 1000 / SPS), so every
SPS file loads as a step-cost model and plans exactly as before; ``to_sps_table`` gives the verify curve
back, or the whole step on SGLang's grid (R = ceil(B / (gamma + 1)) requests, all drafting) for engines
that read SPS tables only; ``to_additive`` / ``from_additive`` map to and from SGLang's additive format.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark.errors import BadFileError
from dspark.scheduler.sps import SPSTable, linear_between

FORMAT = "dspark-step-cost"
VERSION = 1
_TOP_KEYS = {"format", "version", "units", "verify", "draft", "host", "host_greedy", "profile"}
PROFILE_KEYS = {"target": str, "drafter": str, "dtype": str, "device": str, "threads": int, "block_size": int,
                "context_len": int, "repeats": int, "source": str}
_ADDITIVE_KEYS = ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds")
#: most integers a conversion from SGLang's interpolated additive table densifies to
MAX_DENSE = 1 << 16


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds against an integer grid (requests or batch tokens), looked up as a floor step."""

    grid: tuple[int, ...]
    ms: tuple[float, ...]
    positive: bool = False  # verify times must be > 0; draft and host times may be 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(self.grid))
        object.__setattr__(self, "ms", tuple(self.ms))
        if not self.grid or len(self.grid) != len(self.ms):
            raise ValueError(f"a cost curve needs one time per grid point and at least one, got {len(self.grid)} "
                             f"points and {len(self.ms)} times")
        for x in self.grid:
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"grid points must be integers >= 1, got {list(self.grid)}")
        if any(a >= b for a, b in zip(self.grid, self.grid[1:])):
            raise ValueError(f"grid points must be strictly increasing, got {list(self.grid)}")
        for t in self.ms:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 or (
                    self.positive and t == 0):
                raise ValueError(f"times must be finite and {'> 0' if self.positive else '>= 0'} ms, got {list(self.ms)}")
        object.__setattr__(self, "ms", tuple(float(t) for t in self.ms))

    @classmethod
    def zero(cls) -> CostCurve:
        return cls((1,), (0.0,))

    def filled(self) -> CostCurve:
        """Every integer from the first grid point to the last, linear between the measured ones
        (``dspark.scheduler.sps.linear_between``)."""
        grid, ms = linear_between(self.grid, self.ms)
        return CostCurve(grid, ms, self.positive)

    @property
    def is_zero(self) -> bool:
        return not any(self.ms)

    def at(self, x: int) -> float:
        """The time at ``x`` (floor step, clamped at both ends)."""
        return self.ms[max(bisect.bisect_right(self.grid, x) - 1, 0)]

    def at_array(self, x: np.ndarray) -> np.ndarray:
        """Vectorised ``at``: int array of any shape -> float64 array of the same shape."""
        grid, ms = self._arrays
        return ms[(np.searchsorted(grid, np.asarray(x, dtype=np.int64), side="right") - 1).clip(min=0)]

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.grid, dtype=np.int64), np.asarray(self.ms, dtype=np.float64)


@dataclass(frozen=True)
class StepCostModel:
    """Whole-step cost: drafting by drafting requests, verification by batch tokens, host work by requests."""

    verify: CostCurve  # batch tokens B -> ms of the target's verify pass
    max_batch_tokens: int  # the most batch tokens one step may run
    draft: CostCurve = field(default_factory=CostCurve.zero)  # drafting requests R_d -> ms
    host: CostCurve = field(default_factory=CostCurve.zero)  # requests R -> ms of the rest of the step
    profile: dict = field(default_factory=dict, compare=False, hash=False)  # what was measured (PROFILE_KEYS)
    #: requests R -> ms of the rest of a step whose requests are all greedy (they compare tokens, no distributions:
    #: several times cheaper than ``host``, which is timed with sampled requests); None: ``host`` for every batch
    host_greedy: CostCurve | None = None

    def __post_init__(self) -> None:
        if self.host_greedy is not None and self.host_greedy.grid != self.host.grid:
            raise ValueError(f"host_greedy must be on host's grid {list(self.host.grid)}, "
                             f"got {list(self.host_greedy.grid)}")
        if not self.verify.positive:
            object.__setattr__(self, "verify", CostCurve(self.verify.grid, self.verify.ms, positive=True))
        mbt = self.max_batch_tokens
        if isinstance(mbt, bool) or not isinstance(mbt, int) or mbt < self.verify.grid[-1]:
            raise ValueError(f"max_batch_tokens must be an integer >= the largest verify sample "
                             f"({self.verify.grid[-1]}), got {mbt!r}")
        for key, value in self.profile.items():
            if key not in PROFILE_KEYS:
                raise ValueError(f"unknown profile key {key!r}; known: {sorted(PROFILE_KEYS)}")
            if value is not None and not isinstance(value, PROFILE_KEYS[key]):
                raise ValueError(f"profile key {key!r} must be a {PROFILE_KEYS[key].__name__} or null, got {value!r}")

    # ---------------------------------------------------------------- costs
    def for_batch(self, greedy_share: float) -> StepCostModel:
        """The model of a batch whose requests are ``greedy_share`` greedy: host work weighted between ``host``
        and ``host_greedy`` (itself where there is no ``host_greedy``)."""
        if self.host_greedy is None:
            return self
        share = min(max(float(greedy_share), 0.0), 1.0)
        host = CostCurve(self.host.grid, tuple((1.0 - share) * s + share * g
                                               for s, g in zip(self.host.ms, self.host_greedy.ms)))
        return StepCostModel(self.verify, self.max_batch_tokens, self.draft, host, self.profile)

    @property
    def verify_only(self) -> bool:
        """True when drafting and host work cost nothing: the plain SPS table's model."""
        return self.draft.is_zero and self.host.is_zero

    def step_ms(self, batch_tokens: int, num_requests: int, num_drafting: int | None = None) -> float:
        """Milliseconds of one step (inf beyond ``max_batch_tokens``); ``num_drafting`` defaults to all requests."""
        return float(self.step_ms_array(np.asarray([batch_tokens]), num_requests, num_drafting)[0])

    def step_ms_array(self, batch_tokens: np.ndarray, num_requests: int, num_drafting: int | None = None) -> np.ndarray:
        """``step_ms`` over an int array of batch tokens (one step's R and R_d): float64, same shape."""
        b = np.asarray(batch_tokens, dtype=np.int64)
        fixed = self.host.at(num_requests) if num_requests > 0 else 0.0
        drafting = num_requests if num_drafting is None else num_drafting
        fixed += self.draft.at(drafting) if drafting > 0 else 0.0
        return np.where(b > self.max_batch_tokens, np.inf, self.verify.at_array(b) + fixed)

    def throughput_array(self, tau: np.ndarray, batch_tokens: np.ndarray, num_requests: int,
                         num_drafting: int | None = None) -> np.ndarray:
        """Expected tokens per second tau * 1000 / step_ms (0 beyond capacity): float64, tau's shape."""
        return np.asarray(tau, dtype=np.float64) * (1000.0 / self.step_ms_array(batch_tokens, num_requests,
                                                                               num_drafting))

    # ---------------------------------------------------------- conversions
    @classmethod
    def from_sps_table(cls, table: SPSTable, profile: dict | None = None) -> StepCostModel:
        """The SPS table as a model with no drafting or host cost: verify_ms = 1000 / SPS."""
        ms = tuple(1000.0 / s for s in table.sample_steps_per_sec)
        return cls(CostCurve(table.sample_batch_tokens, ms, positive=True), table.max_batch_tokens,
                   profile=dict(profile or {"source": "sps table"}))

    def to_sps_table(self, whole_step: bool = False, block_size: int | None = None) -> SPSTable:
        """An SPS table: the verify pass alone (exact inverse of ``from_sps_table``), or with ``whole_step`` the
        whole step at each verify sample B with R = ceil(B / (gamma + 1)) requests, all drafting (SGLang's
        profiling grid, docs/interop.md §SPS table); gamma = ``block_size``, default the profiled one."""
        grid = self.verify.grid
        if not whole_step:
            return SPSTable(grid, tuple(1000.0 / t for t in self.verify.ms), self.max_batch_tokens)
        gamma = block_size if block_size is not None else self.profile.get("block_size")
        if gamma is None or gamma < 0:
            raise ValueError("whole_step needs the block size (gamma) the grid was profiled with")
        sps = tuple(1000.0 / self.step_ms(b, math.ceil(b / (gamma + 1))) for b in grid)
        return SPSTable(grid, sps, self.max_batch_tokens)

    def to_additive(self) -> dict:
        """SGLang's additive table: step_time = bias + interp(alpha, requests) + interp(theta, batch tokens).

        SGLang interpolates linearly between probes where this model is a floor step; they agree at every
        probe, and everywhere when the grids are dense (every integer)."""
        requests = sorted(set(self.draft.grid) | set(self.host.grid))
        return {
            "bias_seconds": 0.0,
            "bs_probes": requests,
            "alpha_seconds": [(self.draft.at(r) + self.host.at(r)) / 1000.0 for r in requests],
            "m_probes": list(self.verify.grid),
            "theta_seconds": [t / 1000.0 for t in self.verify.ms],
        }

    @classmethod
    def from_additive(cls, data: dict, profile: dict | None = None) -> StepCostModel:
        """SGLang's additive table, sampled at every integer up to its last probes (so the floor step equals
        SGLang's linear interpolation at every integer request and token count). Its per-request term
        (bias + alpha) becomes host cost: the format does not separate drafting from host work."""
        missing = [k for k in _ADDITIVE_KEYS if k not in data]
        if missing or set(data) - set(_ADDITIVE_KEYS):
            raise ValueError(f"SGLang's additive table has exactly the keys {list(_ADDITIVE_KEYS)}; missing {missing}, "
                             f"unknown {sorted(set(data) - set(_ADDITIVE_KEYS))}")
        bias = data["bias_seconds"]
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) or bias < 0:
            raise ValueError(f"bias_seconds must be a finite number >= 0, got {bias!r}")
        req_grid, alpha = _probes(data, "bs_probes", "alpha_seconds")
        tok_grid, theta = _probes(data, "m_probes", "theta_seconds")
        reqs = np.arange(1, req_grid[-1] + 1)
        toks = np.arange(1, tok_grid[-1] + 1)
        host = (bias + np.interp(reqs, req_grid, alpha)) * 1000.0
        verify = np.interp(toks, tok_grid, theta) * 1000.0
        return cls(CostCurve(tuple(int(b) for b in toks), tuple(verify.tolist()), positive=True), int(toks[-1]),
                   host=CostCurve(tuple(int(r) for r in reqs), tuple(host.tolist())),
                   profile=dict(profile or {"source": "sglang additive table"}))

    # ----------------------------------------------------------------- json
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "units": "ms",
            "verify": {"batch_tokens": list(self.verify.grid), "ms": list(self.verify.ms),
                       "max_batch_tokens": self.max_batch_tokens},
            "draft": {"requests": list(self.draft.grid), "ms": list(self.draft.ms)},
            "host": {"requests": list(self.host.grid), "ms": list(self.host.ms)},
            **({} if self.host_greedy is None else
               {"host_greedy": {"requests": list(self.host_greedy.grid), "ms": list(self.host_greedy.ms)}}),
            "profile": dict(self.profile),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict) -> StepCostModel:
        """A step-cost object, a plain SPS table (zero draft and host cost) or SGLang's additive table."""
        if not isinstance(data, dict):
            raise ValueError(f"a step-cost or SPS JSON must be an object, got {type(data).__name__}")
        if "format" not in data:
            if set(_ADDITIVE_KEYS) & data.keys():
                return cls.from_additive(data)
            return cls.from_sps_table(SPSTable.from_dict(data))
        if data["format"] != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {data['format']!r}")
        if data.get("version") != VERSION:
            raise ValueError(f"this is step-cost version {data.get('version')!r}; this dspark reads version {VERSION}")
        if data.get("units") != "ms":
            raise ValueError(f"units must be 'ms', got {data.get('units')!r}")
        unknown = sorted(set(data) - _TOP_KEYS)
        if unknown or "verify" not in data:
            raise ValueError(f"step-cost keys are {sorted(_TOP_KEYS)} (verify required); unknown {unknown}")
        verify = _section(data, "verify", "batch_tokens", {"max_batch_tokens"})
        draft = _section(data, "draft", "requests") if "draft" in data else None
        host = _section(data, "host", "requests") if "host" in data else None
        host_greedy = _section(data, "host_greedy", "requests") if "host_greedy" in data else None
        if host_greedy and not host:
            raise ValueError("host_greedy needs host (the same grid, timed with sampled requests)")
        profile = data.get("profile", {})
        if not isinstance(profile, dict):
            raise ValueError(f"profile must be an object, got {profile!r}")
        return cls(CostCurve(*verify, positive=True), data["verify"]["max_batch_tokens"],
                   CostCurve(*draft) if draft else CostCurve.zero(), CostCurve(*host) if host else CostCurve.zero(),
                   dict(profile), CostCurve(*host_greedy) if host_greedy else None)

    @classmethod
    def from_json(cls, text: str) -> StepCostModel:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        """Read ``path`` (step-cost, SPS or SGLang additive JSON); ``BadFileError`` naming the file if it is bad."""
        path = Path(path)
        if not path.is_file():
            raise BadFileError(f"cost table file {path} does not exist; profile one with `dspark profile`")
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BadFileError(f"cost table file {path}: {e}") from None


def as_step_cost(cost: StepCostModel | SPSTable) -> StepCostModel:
    """What the planners read: a step-cost model as it is, an SPS table as a verify-only model."""
    if isinstance(cost, StepCostModel):
        return cost
    if isinstance(cost, SPSTable):
        return StepCostModel.from_sps_table(cost)
    raise TypeError(f"expected a StepCostModel or an SPSTable, got {type(cost).__name__}")


def _section(data: dict, name: str, grid_key: str, extra: set[str] = frozenset()) -> tuple[list[int], list[float]]:
    part = data[name]
    keys = {grid_key, "ms"} | set(extra)
    if not isinstance(part, dict) or set(part) != keys:
        raise ValueError(f"{name!r} must be an object with exactly the keys {sorted(keys)}, got {part!r}")
    if not isinstance(part[grid_key], list) or not isinstance(part["ms"], list):
        raise ValueError(f"{name}.{grid_key} and {name}.ms must be lists")
    return part[grid_key], part["ms"]


def _probes(data: dict, grid_key: str, value_key: str) -> tuple[np.ndarray, np.ndarray]:
    grid, values = data[grid_key], data[value_key]
    if not isinstance(grid, list) or not isinstance(values, list) or not grid or len(grid) != len(values):
        raise ValueError(f"{grid_key} and {value_key} must be non-empty lists of equal length")
    CostCurve(tuple(grid), tuple(v * 1000.0 if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                                 for v in values))  # the same checks as a curve of ours
    if grid[-1] > MAX_DENSE:
        raise ValueError(f"{grid_key} reaches {grid[-1]}; at most {MAX_DENSE} is converted")
    return np.asarray(grid, dtype=np.float64), np.asarray(values, dtype=np.float64)
