"""Verification-length policies: how many draft tokens of each request the target verifies.

Shapes: R = requests in the batch, K = most draft tokens any request proposed
this step; row r uses its first ``num_candidates[r]`` entries, the rest is
padding and is ignored.

Every policy maps per-step confidences c_{r,j} (calibrated, in [0, 1]; the
confidence head's eq. (7) after STS) to ``verify_len`` l_r in
[0, num_candidates[r]]: the target then checks 1 + l_r positions of request r
(its anchor plus l_r drafts). Survival is a_{r,j} = prod_{i<=j} c_{r,i}
(§3.2.2), computed here by ``survival_from_confidences``.

Losslessness. Rejection sampling keeps the target distribution only if the
decision "is draft x_{r,j} verified" depends on x_{r,<j} (plus anything
independent of request r's current drafts: other requests, the past), never
on x_{r,j} or later drafts. Because c_{r,j+1} reads x_{r,j} (Markov feature),
a_{r,j+1} carries information about x_{r,j}: a policy that looks at a_{r,j+1}
before deciding about position j leaks. Algorithm 1's early stop and the
async variant's lagged capacity are what make them causal;
``RetrospectiveGlobalSearch`` (paper Appendix A) is the biased counter-example
and exists for tests and ablations only.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.scheduler.request_gate import drafting_subset, own_acceptance
from dspark.scheduler.sps import SPSTable
from dspark.scheduler.step_cost import StepCostModel, as_step_cost


class PolicyError(DSparkError):
    """A verify policy that cannot be parsed or used (a ``--policy`` value, STS temperatures, a fallback)."""


@runtime_checkable
class VerifyPolicy(Protocol):
    """The verify-length policy: chooses per-request verify lengths for one step.

    The one policy type of the package: ``speculative_step`` (generate, eval,
    serve) calls ``choose`` through ``dspark.scheduler.confidence.ConfidenceAdapter``,
    which turns a draft block's confidence logits into ``confidences``.
    """

    #: False if the policy works without a confidence head (``confidences=None``)
    requires_confidences: ClassVar[bool]

    def choose(
        self,
        confidences: torch.Tensor | None,  # (R, K) per-step c_{r,j}; padding ignored
        num_candidates: torch.Tensor,  # (R,) int, 0 <= n_r <= K
    ) -> torch.Tensor:  # (R,) int64 verify_len, 0 <= l_r <= n_r
        ...


# ----------------------------------------------------------------- helpers
def _check_num_candidates(num_candidates: torch.Tensor, max_tokens: int | None) -> np.ndarray:
    """``num_candidates`` checked, as an int64 NumPy array (R,) on the host."""
    if not isinstance(num_candidates, torch.Tensor) or num_candidates.dim() != 1:
        raise ValueError("num_candidates must be a 1-D integer tensor of shape (R,)")
    if num_candidates.dtype.is_floating_point or num_candidates.dtype == torch.bool:
        raise ValueError(f"num_candidates must be an integer tensor, got {num_candidates.dtype}")
    n = _host(num_candidates).astype(np.int64, copy=False)
    if n.size and n.min() < 0:
        raise ValueError("num_candidates must be >= 0")
    if max_tokens is not None and n.size and n.max() > max_tokens:
        raise ValueError(f"num_candidates must be <= K = {max_tokens} (the width of confidences)")
    return n


def _check_confidences(
    confidences: torch.Tensor | None, num_candidates: torch.Tensor, policy: str
) -> tuple[np.ndarray, np.ndarray]:
    """(confidences (R, K) float64, num_candidates (R,) int64), checked, as NumPy arrays on the host."""
    if confidences is None:
        raise ValueError(
            f"{policy} needs per-step confidences from a confidence head; this drafter has none. "
            "Use FixedLength (e.g. FixedLength(gamma) = verify-all) instead"
        )
    if confidences.dim() != 2:
        raise ValueError(f"confidences must have shape (R, K), got {tuple(confidences.shape)}")
    n = _check_num_candidates(num_candidates, confidences.shape[1])
    if n.shape[0] != confidences.shape[0]:
        raise ValueError(
            f"confidences has {confidences.shape[0]} rows but num_candidates has {n.shape[0]}"
        )
    return _host(confidences), n


def _host(x: torch.Tensor) -> np.ndarray:
    """A (small) tensor as a NumPy array on the host (floats as float64). The policies' arithmetic runs
    in NumPy: on (R, K) arrays of a few hundred entries its per-call cost is a fraction of torch's."""
    x = x.detach()
    if x.dtype.is_floating_point:
        x = x.to(torch.float64)
    return x.cpu().numpy()


def _survival(
    confidences: np.ndarray,  # (R, K) per-step c_{r,j}
    num_candidates: np.ndarray,  # (R,) int64
) -> np.ndarray:  # (R, K) float64 a_{r,j}; 0 beyond num_candidates
    conf = confidences.astype(np.float64, copy=False)
    valid = np.arange(conf.shape[1])[None, :] < num_candidates[:, None]
    conf = np.where(valid, conf, 0.0)
    if not ((conf >= 0) & (conf <= 1)).all():  # NaN fails too
        raise ValueError("confidences must lie in [0, 1] (apply the sigmoid and STS before scheduling)")
    # c <= 1, so the product never increases along j (exactly, also in floating point)
    return np.cumprod(conf, axis=1)


def survival_from_confidences(
    confidences: torch.Tensor,  # (R, K) per-step c_{r,j} in [0, 1]
    num_candidates: torch.Tensor,  # (R,) int
) -> torch.Tensor:  # (R, K) float64 a_{r,j} = prod_{i<=j} c_{r,i}; 0 beyond num_candidates
    """Cumulative survival (§3.2.2); padding gets survival 0 and is never admitted."""
    return torch.from_numpy(_survival(_host(confidences), _host(num_candidates).astype(np.int64, copy=False)))


def _admission_path(survival: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates (r, j) with a_{r,j} > 0 sorted by survival, best first.

    Ties are broken by position j, then request r (deterministic). As a_{r,j}
    is non-increasing in j, every prefix of this path admits per-request
    prefixes. Returns row (M,), position (M,) and survival (M,) float64.
    """
    R, K = survival.shape
    flat = survival.T.reshape(-1)  # (K * R,), index = j * R + r: ties keep j-then-r order
    order = np.argsort(-flat, kind="stable")  # descending; stable keeps that order among ties
    sorted_a = flat[order]
    keep = sorted_a > 0  # Algorithm 1, line 4: E = {(r, j) | a_{r,j} > 0}
    order, sorted_a = order[keep], sorted_a[keep]
    return order % R, order // R, sorted_a


def _theta_curve(sorted_a: np.ndarray, num_requests: int, cost: StepCostModel, num_drafting: int,
                 weight: float = 1.0) -> np.ndarray:
    """Theta(b) after admitting the first b path entries, b = 0..M: expected tokens per second of the step.

    tau(b) = R + sum of the b admitted survivals, B(b) = R + b (§3.2.2), and Theta(b) = tau(b) * 1000 /
    (draft_ms(R_d) + verify_ms(B(b)) + host_ms(R)) (``dspark.scheduler.step_cost``); for a plain SPS
    table (no draft or host cost) that is the paper's tau(b) * SPS(B(b)). ``weight`` w: each entry stands for w
    (survivals of fewer requests scaled to R): tau(b) = R + w * the sum, B(b) = R + round(w * b).
    """
    # summed in admission order from R, as Algorithm 1 accumulates tau* (lines 5, 8)
    if weight == 1.0:
        tau = np.concatenate([[float(num_requests)], sorted_a]).cumsum()  # (M + 1,)
        batch_tokens = num_requests + np.arange(tau.size)  # (M + 1,)
    else:
        tau = num_requests + weight * np.concatenate([[0.0], sorted_a]).cumsum()  # (M + 1,)
        batch_tokens = num_requests + np.rint(weight * np.arange(tau.size)).astype(np.int64)
    return cost.throughput_array(tau, batch_tokens, num_requests, num_drafting)


def _num_drafting(num_candidates: np.ndarray) -> int:
    """R_d: requests that proposed at least one draft this step (they paid for drafting)."""
    return int((num_candidates > 0).sum())


def _lengths_from_path(
    rows: np.ndarray,  # (M,) request of each path entry
    positions: np.ndarray,  # (M,) 0-based draft position j - 1
    count: int,
    shape: tuple[int, int],  # (R, K)
) -> np.ndarray:  # (R,) int64
    """verify_len from admitting the first ``count`` path entries."""
    admitted = np.zeros(shape, dtype=np.int64)
    admitted[rows[:count], positions[:count]] = 1
    # Prefix guard: (r, j) only counts if (r, j-1) was admitted too.
    verify_len = admitted.cumprod(axis=1).sum(axis=1)
    assert int(verify_len.sum()) == count, "admission path broke the per-request prefix order"
    return verify_len


def _as_verify_len(verify_len: np.ndarray, like: torch.Tensor) -> torch.Tensor:  # (R,) int64 on like's device
    return torch.from_numpy(verify_len.astype(np.int64, copy=False)).to(like.device)


# ----------------------------------------------------------------- policies
@dataclass(frozen=True)
class FixedLength:
    """Verify min(n, n_r) drafts: n=1 is the MTP-1-like baseline, n=gamma verify-all."""

    n: int
    requires_confidences: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError(f"FixedLength needs n >= 0, got {self.n}")

    @property
    def max_verify_len(self) -> int:
        """The most drafts a request ever verifies: ``speculative_step`` proposes no more (MTP-1 drafts one)."""
        return self.n

    def choose(self, confidences: torch.Tensor | None, num_candidates: torch.Tensor) -> torch.Tensor:
        n = _check_num_candidates(num_candidates, None if confidences is None else confidences.shape[1])
        return _as_verify_len(n.clip(max=self.n), num_candidates)


@dataclass(frozen=True)
class StaticThreshold:
    """Truncate at the first per-step confidence c_{r,j} < threshold (DeepSpec semantics).

    Per-step, not cumulative: draft j is verified iff c_{r,1..j} are all >= threshold.
    threshold = 0 verifies everything.
    """

    threshold: float
    requires_confidences: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"StaticThreshold needs a threshold in [0, 1], got {self.threshold}")

    def choose(self, confidences: torch.Tensor | None, num_candidates: torch.Tensor) -> torch.Tensor:
        confidences, n = _check_confidences(confidences, num_candidates, "StaticThreshold")
        c = confidences
        _survival(c, n)  # validates the range
        valid = np.arange(c.shape[1])[None, :] < n[:, None]
        passes = (c >= self.threshold) & valid  # (R, K)
        return _as_verify_len(passes.astype(np.int64).cumprod(axis=1).sum(axis=1), num_candidates)


@dataclass(frozen=True)
class GreedyPrefixScheduler:
    """Algorithm 1: greedy admission by survival with a causal early stop.

    ``cost``: a ``StepCostModel`` (whole step) or an ``SPSTable`` (verify pass only: no draft or host cost)."""

    cost: StepCostModel | SPSTable
    requires_confidences: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", as_step_cost(self.cost))

    def choose(self, confidences: torch.Tensor | None, num_candidates: torch.Tensor) -> torch.Tensor:
        confidences, n = _check_confidences(confidences, num_candidates, "GreedyPrefixScheduler")
        R = confidences.shape[0]
        survival = _survival(confidences, n)  # Algorithm 1, lines 1-3
        rows, positions, sorted_a = _admission_path(survival)  # line 4
        # Lines 5-6: l_r = 0, B = R, tau* = R, Theta_best = Theta(0). Lines 7-9 for the b-th
        # admission give Theta(b) = (R + sum_{i<=b} a_(i)) / step cost at B = R + b, which is
        # (R + sum_{i<=b} a_(i)) * SPS(R + b) on a plain SPS table (``_theta_curve``).
        theta = _theta_curve(sorted_a, R, self.cost, _num_drafting(n))  # (M + 1,)
        # Lines 10-13: keep admitting while Theta > Theta_best; break at the first
        # admission that does not raise it. Until then Theta_best = Theta(b - 1), so
        # the stop is the first b with Theta(b) <= Theta(b - 1). Whether (r, j) is
        # admitted depends only on the path before it: survivals >= a_{r,j}, i.e.
        # other requests and a_{r,<=j}, never on x_{r,j} (read by a_{r,j+1}).
        not_raised = np.flatnonzero(theta[1:] <= theta[:-1])
        count = int(not_raised[0]) if not_raised.size else sorted_a.size
        return _as_verify_len(_lengths_from_path(rows, positions, count, survival.shape), num_candidates)  # line 16


@dataclass(frozen=True)
class RetrospectiveGlobalSearch:
    """BIASED: argmax of Theta over the whole admission path (paper Appendix A).

    Looking past the first non-improving admission lets a_{r,j+1}, which
    depends on x_{r,j}, decide whether x_{r,j} is verified: the verified tokens
    are then selected by their own value and the output is no longer the
    target's distribution. Kept only to demonstrate the bias; never serve it.
    """

    cost: StepCostModel | SPSTable
    requires_confidences: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", as_step_cost(self.cost))

    def choose(self, confidences: torch.Tensor | None, num_candidates: torch.Tensor) -> torch.Tensor:
        confidences, n = _check_confidences(confidences, num_candidates, "RetrospectiveGlobalSearch")
        survival = _survival(confidences, n)
        rows, positions, sorted_a = _admission_path(survival)
        theta = _theta_curve(sorted_a, confidences.shape[0], self.cost, _num_drafting(n))
        count = int(np.argmax(theta))  # first maximum: fewest tokens among ties
        return _as_verify_len(_lengths_from_path(rows, positions, count, survival.shape), num_candidates)


@dataclass
class AsyncTopKScheduler:
    """§5.2: capacity from lagged survivals, then top-K current candidates.

    The capacity K (draft tokens verified this step, over all requests) is
    K* = argmax_b Theta(b) with tau(b) = R + the sum of the top-b survivals of ``lag`` steps ago, an
    unconstrained global search over the (jagged) cost table (``_theta_curve``: the whole step's cost for a
    ``StepCostModel``, tau(b) * SPS(R + b) for an ``SPSTable``). This step's
    candidates are then admitted by their current survival, best first, up to
    K* (ties: position, then request). K* never sees this step's drafts, and
    whether (r, j) ranks in the top K* depends only on other requests and
    a_{r,<=j}, so the scheme is lossless.

    ``choose`` records this step's survivals itself: call it exactly once per
    engine step. Until ``lag`` steps have been seen, the capacity is
    ``default_capacity`` (None = verify every candidate). ``reset`` forgets
    the history. R is this step's request count; the lagged pool may come from
    a different set of requests (an approximation, as in the paper).

    ``should_draft`` decides, before a step drafts, whether it drafts at all
    (docs/serving/step-cost.md §Skipping the drafter): where the cost model prices drafting (``draft_ms``), a step
    skips the drafter and verifies its anchors only (``speculative_step``) when a plain step is expected to make
    more tokens per second. The expectation is their measured rates once ``observe_step`` has timed both kinds of
    step at this request count, drafting at least ``min_drafting_steps`` times (each kind's average tokens per step
    over its average seconds per step: the mean over its first ``RATE_WINDOW`` steps, then a moving average of that
    window); before, the measured gain at the nearest request count within a factor of 2, moved to this one as the
    cost model's gain moves (``_expected_gain``); with nothing measured near, the cost model's, on the newest
    survivals, after one plain step measured at this count (``_plain_unmeasured``). Every ``probe_every``-th
    decision starts a probe of the other kind: one plain step (a plain step's rate barely moves), or ``probe_steps``
    drafting steps whose mean replaces drafting's rate, since drafting ran rarely and the content of the requests
    moves acceptance. While drafting's window is shorter than ``RATE_WINDOW`` steps and its measured gain lies within
    ``SETTLE_Z`` standard errors of 1, drafting goes on to measure (``_gain_within_noise``). Drafting probes come
    r^2 times rarer where a drafting step costs r plain ones (``_probe_interval``; not while the gain is within noise
    of 1), and 4 times sooner while most of the batch has never drafted where r <=
    ``NEW_BATCH_MAX_RATIO``: acceptance belongs to the requests, and the window measured others (one request at a
    time, each new prompt would otherwise inherit the last one's verdict for most of its steps). A drafting step
    right after a plain one is not measured: its drafter first catches up on the context the plain steps left, a
    cost steady drafting spreads over its steps. In a step it skips, ``drafting_requests`` still lets the requests
    whose own past acceptance pays for their drafting draft (docs/serving/step-cost.md §Drafting some requests).
    It reads past steps, R and the requests' past acceptance only, never this step's drafts, so it is lossless like
    the capacity. ``draft_bound`` caps how deep a request drafts from the same lagged capacity, and host work is
    priced by the batch's share of greedy requests (``greedy_share``, set by the step;
    docs/serving/step-cost.md §What the profile times, and how the planner reads it).
    """

    cost: StepCostModel | SPSTable
    lag: int = 2
    default_capacity: int | None = None
    probe_every: int = 32
    probe_steps: int = 4
    requires_confidences: ClassVar[bool] = True
    last_capacity: int | None = field(default=None, init=False)
    skipped_steps: int = field(default=0, init=False)  # steps whose drafter ran for no request, in all
    _history: deque = field(init=False, repr=False)  # (sorted positive survivals (M',), drafting requests R_d)
    _depths: deque = field(init=False, repr=False)  # (M',) 0-based draft position of each entry of _history's pool
    _since_probe: int = field(default=0, init=False, repr=False)  # decisions since the last probe started
    _rates: dict = field(default_factory=dict, init=False, repr=False)  # (R, drafted) -> [steps, tokens, seconds]
    _probe_left: int = field(default=0, init=False, repr=False)  # steps of the running probe still to come
    _probe_kind: bool = field(default=False, init=False, repr=False)  # whether the running probe drafts
    _fresh: tuple | None = field(default=None, init=False, repr=False)  # (R, drafted) the probe measures anew
    _last_drafted: bool = field(default=False, init=False, repr=False)  # whether the last observed step drafted
    _last_probe: bool = field(default=False, init=False, repr=False)  # whether should_draft's last answer was a probe
    _marginal: dict = field(default_factory=dict, init=False, repr=False)  # R -> [steps, s one drafting request adds]
    #: share of greedy requests in the current batch (the step sets it before drafting): host work is priced with it
    #: (``StepCostModel.for_batch``); 0 = every request sampled, as ``host`` was timed
    greedy_share: float = field(default=0.0, init=False)
    _priced: tuple | None = field(default=None, init=False, repr=False)  # (cost, share in 64ths, cost.for_batch of it)

    def __post_init__(self) -> None:
        self.cost = as_step_cost(self.cost)
        if self.lag < 1:
            raise ValueError(
                f"AsyncTopKScheduler needs lag >= 1, got {self.lag} (lag 0 would size the batch "
                "from the current drafts: the biased retrospective search)"
            )
        if self.default_capacity is not None and self.default_capacity < 0:
            raise ValueError(f"default_capacity must be >= 0 or None, got {self.default_capacity}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if not 1 <= self.probe_steps < max(self.probe_every, 2):
            raise ValueError(f"probe_steps must be >= 1 and below probe_every ({self.probe_every}), "
                             f"got {self.probe_steps}")
        self._history = deque(maxlen=self.lag)
        self._depths = deque(maxlen=self.lag)

    RATE_WINDOW: ClassVar[int] = 16  # steps of one kind the measured rate averages over
    #: where a drafting step costs at most this many plain ones, drafting probes come 4 times sooner while most of the
    #: batch has never drafted (``should_draft``'s ``never_drafted``)
    NEW_BATCH_MAX_RATIO: ClassVar[float] = 1.5
    #: in a plain step, requests without a record of their own draft (to get one) where a request committing this many
    #: tokens per drafting step would pay for its drafting (``drafting_requests``)
    EXPLORE_ACCEPTANCE: ClassVar[float] = 2.0
    #: standard errors of the measured gain within which drafting goes on measuring (``_gain_within_noise``)
    SETTLE_Z: ClassVar[float] = 2.0

    @property
    def _batch_cost(self) -> StepCostModel:
        """The cost model priced for this batch's sampling (``greedy_share``), in 1/64 steps of the share; rebuilt only
        when the share moves."""
        share = round(self.greedy_share * 64)
        if self._priced is None or self._priced[0] is not self.cost or self._priced[1] != share:
            self._priced = (self.cost, share, self.cost.for_batch(share / 64))
        return self._priced[2]

    @property
    def min_drafting_steps(self) -> int:
        """Measured drafting steps at a request count before their rate decides there: what a drafting probe
        measures, ``probe_steps`` - 1 (its first step catches up), 3 by default. One step commits 1 to 1 + K tokens
        per request, so the rate of one step is mostly luck (one 1-token step once put a whole MT-Bench prompt on
        plain steps, ``scripts/draft_gate_rates.py``)."""
        return max(1, self.probe_steps - 1)

    def reset(self) -> None:
        self._history.clear()
        self._depths.clear()
        self.last_capacity = None
        self._since_probe = 0
        self._rates.clear()
        self._marginal.clear()
        self._probe_left, self._fresh, self._last_drafted, self._last_probe = 0, None, False, False

    def should_draft(self, num_requests: int, never_drafted: int = 0) -> bool:
        """Whether a step of ``num_requests`` requests drafts (class doc); ``never_drafted`` of them have not drafted
        yet (``RequestState.drafted_steps``). Always where the cost model has no drafting cost or no survivals have
        been seen yet."""
        if self.cost.draft.is_zero or len(self._history) < self.lag or num_requests < 1:
            return True
        noisy = self._gain_within_noise(num_requests)
        if self._plain_unmeasured(num_requests):
            draft = False  # a plain step is the cheap one to learn: measured first, it decides sooner
        else:  # while drafting's measured rate cannot tell which kind is faster, drafting goes on to measure it
            draft = self._expected_gain(num_requests) >= 1.0 or (
                noisy and self.measured(num_requests)[0][0] < self.RATE_WINDOW)
        interval = self._probe_interval(num_requests, probe_drafts=not draft, within_noise=noisy)
        if not draft and 2 * never_drafted > num_requests and \
                interval <= (self.probe_every - 1) * self.NEW_BATCH_MAX_RATIO ** 2:
            interval //= 4  # most of the batch is new to drafting: the window measured other requests' acceptance
        self._last_probe = True
        if self._probe_left > 0:  # a probe goes on with the kind it started with
            self._probe_left -= 1
            draft = self._probe_kind
        elif self._since_probe >= interval:
            draft = self._probe_kind = not draft  # a probe starts: the other kind of step
            self._since_probe = 0
            if draft:  # drafting probes run probe_steps steps and measure drafting anew
                self._probe_left, self._fresh = self.probe_steps - 1, (num_requests, True)
        else:
            self._since_probe += 1
            self._last_probe = False
        self.skipped_steps += not draft
        return draft

    def drafting_requests(self, requests: list) -> list[bool]:
        """Which of this step's requests (``RequestState``s) draft: all where ``should_draft`` says so; none in a
        plain probe; else those whose own past acceptance makes drafting them pay (``dspark.scheduler.request_gate``),
        and, where a request of ``EXPLORE_ACCEPTANCE`` would pay, those without a record of their own yet
        (``request_gate.MIN_OWN_STEPS`` drafting steps); priced by the measured plain step at this request count and
        the measured cost of one more drafting request (``_marginal_seconds``)."""
        R = len(requests)
        if self.should_draft(R, sum(r.drafted_steps == 0 for r in requests)):
            return [True] * R
        plain = self.measured(R)[1]
        if self._last_probe or plain is None:
            return [False] * R
        acceptance = [own_acceptance(r.drafted_steps, r.drafted_tokens) for r in requests]
        marginal = self._marginal_seconds(R, plain[2])
        chosen = drafting_subset(acceptance, plain[2], marginal)
        if (self.EXPLORE_ACCEPTANCE - 1.0) * plain[2] > R * marginal:
            # a request without a record of its own drafts until it has one where a typical drafting request would
            # pay: a few steps of its drafting cost little beside never finding the requests whose drafting pays
            chosen = [c or a is None for c, a in zip(chosen, acceptance)]
        self.skipped_steps -= any(chosen)  # the drafter runs after all
        return chosen

    def _marginal_seconds(self, num_requests: int, plain_s: float) -> float:
        """Seconds one more drafting request adds to a plain step of ``num_requests`` requests: measured in steps
        where some requests drafted (at this count, else the nearest within a factor of 2); else a measured drafting
        step's extra time over a plain one, per request (what one request costs when all draft, a floor for one
        alone); else the cost model's step with one request drafting (verifying its share of the newest proposals)
        over its plain step, times the measured plain step."""
        near = [r for r in self._marginal if num_requests / 2 <= r <= 2 * num_requests]
        if near:
            best = min(near, key=lambda r: (abs(r - num_requests), -r))
            return self._marginal[best][1]
        drafted = self.measured(num_requests)[0]
        if drafted is not None and drafted[0] >= self.min_drafting_steps:
            return max(drafted[2] - plain_s, 0.01 * plain_s) / num_requests
        pool, drafting = self._history[-1]
        verified = int(round(len(pool) / max(drafting, 1)))
        plain_ms = self._batch_cost.step_ms(num_requests, num_requests, 0)
        one_ms = self._batch_cost.step_ms(num_requests + verified, num_requests, 1)
        return max(one_ms - plain_ms, 0.0) / plain_ms * plain_s

    def observe_step(self, num_requests: int, drafted: bool, tokens: int, seconds: float,
                     num_drafting: int | None = None) -> None:
        """A finished step of ``num_requests`` requests: whether it drafted, the tokens it committed, its time.
        Kept per request count (a rate measured at another count would mix in how the step's cost grows with it).
        Tokens and seconds are averaged apart and divided only when compared: a drafting step commits 1 to 1 + K
        tokens per request, so the mean of per-step rates would swing with each step's luck (and the rarely run kind,
        renewed by a probe every ``probe_every`` steps, would keep a lucky or unlucky value for long).
        A step where only ``num_drafting`` < R requests drafted (``drafting_requests``) measures what one drafting
        request adds to the plain step at this count instead."""
        if seconds <= 0 or num_requests < 1:
            return
        if drafted and num_drafting is not None and 0 < num_drafting < num_requests:
            self._last_drafted = False  # the requests left out catch up at the next step where all draft
            plain = self.measured(num_requests)[1]
            if plain is not None:
                entry = self._marginal.setdefault(num_requests, [0, 0.0])
                entry[0] += 1
                added = max((seconds - plain[2]) / num_drafting, 0.01 * plain[2])  # timing noise stays positive
                entry[1] += (added - entry[1]) / min(entry[0], self.RATE_WINDOW)
            return
        catching_up, self._last_drafted = drafted and not self._last_drafted, bool(drafted)
        if catching_up:
            return  # the drafter caught up on the context of the plain steps before: not a steady drafting step
        key = (num_requests, bool(drafted))
        if key == self._fresh:  # a probe's first measured step: that kind's old window is stale
            self._rates.pop(key, None)
            self._fresh = None
        entry = self._rates.setdefault(key, [0, 0.0, 0.0, 0.0, 0.0, 0.0])  # steps, then the means of t, s, t², s², ts
        entry[0] += 1
        weight = 1.0 / min(entry[0], self.RATE_WINDOW)  # the plain mean at first, then a moving average
        for i, value in enumerate((tokens, seconds, tokens * tokens, seconds * seconds, tokens * seconds), start=1):
            entry[i] += weight * (value - entry[i])

    def measured(self, num_requests: int) -> tuple[tuple[int, float, float] | None, tuple[int, float, float] | None]:
        """What ``observe_step`` measured at ``num_requests`` requests, for drafting and for plain steps: (steps,
        tokens per step, seconds per step) each, None where that kind has not been measured there."""
        return tuple(None if (e := self._rates.get((num_requests, kind))) is None else (e[0], e[1], e[2])
                     for kind in (True, False))

    def _relative_variance(self, num_requests: int, drafted: bool) -> float:
        """The variance of log(rate) of one kind of step at ``num_requests``, as its window measures it: tokens over
        seconds of n steps (n = its steps, at most ``RATE_WINDOW``) has relative variance
        (Var t / t̄² + Var s / s̄² - 2 Cov(t, s) / (t̄ s̄)) / n (the delta method), the step-to-step variances with
        n / (n - 1). 0 below 2 steps (nothing to estimate it from: a plain step's rate barely moves)."""
        entry = self._rates.get((num_requests, drafted))
        if entry is None or entry[0] < 2:
            return 0.0
        _, t, s, tt, ss, ts = entry
        if t <= 0 or s <= 0:
            return 0.0
        n = min(entry[0], self.RATE_WINDOW)
        spread = (tt - t * t) / (t * t) + (ss - s * s) / (s * s) - 2.0 * (ts - t * s) / (t * s)
        return max(spread, 0.0) / (n - 1)

    def _gain_within_noise(self, num_requests: int) -> bool:
        """Whether both kinds were measured at ``num_requests`` and the measured gain lies within ``SETTLE_Z``
        standard errors of 1 (on log scale): the window cannot tell which kind is faster."""
        if not self._both_measured(num_requests):
            return False
        gain = self._measured_gain(num_requests)
        if gain <= 0:
            return False
        spread = self._relative_variance(num_requests, True) + self._relative_variance(num_requests, False)
        return abs(math.log(gain)) < self.SETTLE_Z * math.sqrt(spread)

    def measured_marginal(self) -> dict[int, tuple[int, float]]:
        """What steps where only some requests drafted measured, by request count: (steps, seconds one more drafting
        request adds to a plain step)."""
        return {r: (e[0], e[1]) for r, e in sorted(self._marginal.items())}

    def _measured_gain(self, num_requests: int) -> float:
        """Drafting's measured rate over plain's at ``num_requests`` (both kinds measured there)."""
        drafted, plain = self.measured(num_requests)
        return (drafted[1] / drafted[2]) / (plain[1] / plain[2])

    def _probe_interval(self, num_requests: int, probe_drafts: bool, within_noise: bool = False) -> int:
        """Decisions between probes: ``probe_every`` - 1 before a plain probe; before a drafting probe that times
        r^2, r = a drafting step's time over a plain step's at this R (measured, else the cost model's drafting
        overhead), so that the probes' share of the time, probe_steps * r / (probe_every * r^2), falls as drafting
        grows dearer (at 32 requests a drafting step costs several plain ones); ``probe_every`` - 1 too while the
        measured gain is within noise of 1 (``within_noise``, ``_gain_within_noise``): then a probe costs about what
        it may gain."""
        interval = self.probe_every - 1
        if not probe_drafts or within_noise:
            return interval  # a drafting step costs about as much per token as a plain one: probing costs little
        drafted, plain = self.measured(num_requests)
        if drafted is not None and plain is not None:
            ratio = drafted[2] / plain[2]
        else:
            ratio = self._batch_cost.step_ms(num_requests, num_requests, num_requests) / self._batch_cost.step_ms(
                num_requests, num_requests, 0)
        return int(interval * max(1.0, ratio) ** 2)

    def _expected_gain(self, num_requests: int) -> float:
        """A drafting step's expected tokens per second over a plain step's at ``num_requests`` requests: measured
        there when both kinds were (``_both_measured``); else measured at the nearest request count R' (within a factor of 2) where both
        were, times how the cost model's gain moves from R' to R (a level of load brings request counts that were
        never seen: the model's error at R' is taken to hold at R); else the cost model's."""
        if self._both_measured(num_requests):
            return self._measured_gain(num_requests)
        near = self._nearest_measured(num_requests)
        if near is None:
            return self._model_gain(num_requests)
        model_near = self._model_gain(near)
        trend = self._model_gain(num_requests) / model_near if model_near > 0 else 1.0
        return self._measured_gain(near) * trend

    def _plain_unmeasured(self, num_requests: int) -> bool:
        """Whether the gate measures steps (``observe_step`` has recorded some) but no plain step at
        ``num_requests`` requests, nor both kinds at a near count: then a plain step runs first, as the model alone
        would have drafting run until the next probe (``probe_every`` decisions) where it is wrong, and a drafting
        step costs several plain ones at many requests."""
        return bool(self._rates) and self.measured(num_requests)[1] is None and \
            self._nearest_measured(num_requests) is None

    def _both_measured(self, num_requests: int) -> bool:
        """Whether a plain step and ``min_drafting_steps`` drafting steps were measured at ``num_requests``."""
        drafted, plain = self.measured(num_requests)
        return plain is not None and drafted is not None and drafted[0] >= self.min_drafting_steps

    def _nearest_measured(self, num_requests: int) -> int | None:
        """The request count nearest ``num_requests`` (ties: the larger) within a factor of 2 where both kinds of
        step were measured, or None."""
        near = [r for r, kind in self._rates
                if kind and num_requests / 2 <= r <= 2 * num_requests and self._both_measured(r)]
        return min(near, key=lambda r: (abs(r - num_requests), -r)) if near else None

    def _model_gain(self, num_requests: int) -> float:
        """The cost model's gain: the best Theta of a drafting step, on the newest recorded survivals scaled to
        ``num_requests`` requests, over a plain step's Theta = R * 1000 / (verify_ms(R) + host_ms(R))."""
        pool, drafting = self._history[-1]
        if drafting < 1:
            return 1.0
        # the pool of R_d requests stands for R requests: each survival counts R / R_d times
        best = _theta_curve(pool, num_requests, self._batch_cost, num_requests, num_requests / drafting).max()
        plain = _theta_curve(pool[:0], num_requests, self._batch_cost, 0)[0]  # no drafts, no drafting cost
        return float(best / plain)

    def capacity(self, num_requests: int, num_drafting: int | None = None) -> int | None:
        """K* for a step with ``num_requests`` requests (``num_drafting`` of them drafting, default all), from
        the survivals ``lag`` steps ago. None when there is no such step yet (the caller's default applies).
        """
        if len(self._history) < self.lag:
            return self.default_capacity
        lagged = self._history[0][0]  # (M',) sorted positive survivals of step t - lag
        drafting = num_requests if num_drafting is None else num_drafting
        theta = _theta_curve(lagged, num_requests, self._batch_cost, drafting)
        return int(np.argmax(theta))

    def draft_bound(self, num_requests: int, num_drafting: int) -> int | None:
        """The most drafts a request proposes in a step of ``num_requests`` requests, ``num_drafting`` of them
        drafting: one position deeper than the deepest entry the capacity K* admits from the lagged pool, at least
        1 (so survivals keep coming); None before ``lag`` steps (no bound). Drafts deeper than that would rarely be
        verified and cost drafting time (DSpark's head drafts position by position), and the pool they would have
        added to is the capacity's only evidence, so the bound can grow by one position per step. Like the capacity
        it reads past steps only, never this step's drafts: lossless."""
        if len(self._history) < self.lag:
            return None
        capacity = self.capacity(num_requests, num_drafting)
        admitted = self._depths[0][:capacity]  # (K*,) 0-based positions, best survival first
        return int(admitted.max()) + 2 if admitted.size else 1

    def choose(self, confidences: torch.Tensor | None, num_candidates: torch.Tensor) -> torch.Tensor:
        confidences, n = _check_confidences(confidences, num_candidates, "AsyncTopKScheduler")
        # before this step's survivals are seen; R_d counts proposals, not their values
        capacity = self.capacity(confidences.shape[0], _num_drafting(n))
        survival = _survival(confidences, n)
        rows, positions, sorted_a = _admission_path(survival)
        count = sorted_a.size if capacity is None else min(capacity, sorted_a.size)
        self.last_capacity = capacity
        self._history.append((sorted_a, _num_drafting(n)))
        self._depths.append(positions)
        return _as_verify_len(_lengths_from_path(rows, positions, count, survival.shape), num_candidates)
