"""Discrete-event simulation of the continuous-batching engine (``dspark.serving.engine``), timed by an SPS table.

Shapes: R = active requests in a step, K = block size (gamma).

One loop iteration is one iteration of ``Engine._run``:

1. admit waiting requests (arrived by now) up to ``max_batch`` active ones and feed at most
   ``prefill_chunk`` of their prompt tokens, oldest first (chunked prefill): the clock advances by the
   prefill time of the chunk; a request whose prompt is complete gets its first token and joins the batch;
2. one speculative step over the active requests: ``DraftSampler`` draws each request's proposal
   (num_tokens, calibrated confidences, which drafts the target would accept); the production verify policy
   (``make_policy`` -> ``ConfidenceAdapter.verify_len``, the object the engine calls) chooses ``verify_len``;
   the clock advances by 1 / SPS(B), B = sum_r (1 + l_r) (paper §3.2.2), plus ``step_overhead_s``; each
   request commits its leading run of accepted drafts among the l_r verified plus one recovered/bonus token;
3. finished requests retire; in a closed loop their user submits the next request at once.

When nothing is active the clock jumps to the next arrival. Arrivals: a closed loop of N users (as
``dspark bench serve``) or Poisson at a rate. Randomness comes from one ``numpy`` generator (``seed``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from dspark.drafters.base import DraftBlock
from dspark.scheduler.adapter import make_policy
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.sps import SPSTable
from dspark.simulate.stats import DraftSampler, DrafterStats, StatsError

_EPS = 1e-9


@dataclass(frozen=True)
class StepClock:
    """Seconds per verify step and per prefill, from SPS tables (docs/interop.md §SPS table)."""

    verify: SPSTable
    prefill: SPSTable | None = None  # None: the verify table; prefill beyond its samples extrapolates
    prefill_enabled: bool = True  # False: prefill runs elsewhere (disaggregated), costs the decode engine 0
    step_overhead_s: float = 0.0  # drafting and host work per step, on top of the verify pass

    def verify_s(self, batch_tokens: int) -> float:
        sps = self.verify.sps(batch_tokens)
        if sps <= 0:
            raise StatsError(f"a verify step of {batch_tokens} batch tokens exceeds the SPS table's "
                             f"max_batch_tokens ({self.verify.max_batch_tokens}); profile larger batches")
        return 1.0 / sps + self.step_overhead_s

    def prefill_s(self, prompt_tokens: int) -> float:
        """1 / SPS(P) within the table; beyond its largest sample, that sample's seconds per token times P."""
        if not self.prefill_enabled or prompt_tokens <= 0:
            return 0.0
        table = self.prefill or self.verify
        last_b, last_sps = table.sample_batch_tokens[-1], table.sample_steps_per_sec[-1]
        if prompt_tokens <= last_b:
            return 1.0 / table.sps(prompt_tokens)
        return prompt_tokens / (last_b * last_sps)


@dataclass(frozen=True)
class Workload:
    """Arrivals and lengths. ``users`` > 0: closed loop; else Poisson at ``rate`` requests/s."""

    users: int = 0
    rate: float = 0.0
    num_requests: int | None = None  # stop after this many requests (closed loop: bench serve's --num-requests)
    duration_s: float | None = None  # or after this much simulated time
    warmup_s: float = 0.0  # duration mode: what happens before it is not measured
    lengths: Sequence[tuple[int, int]] = ((128, 256),)  # (prompt tokens, output tokens), used round-robin
    # request i drafts from the stats' domain domains[i % len] (per-request statistics of a trace, in the same
    # round-robin order as lengths); None: a domain drawn by the domains' weights
    domains: Sequence[int] | None = None
    max_batch: int | None = None  # default: the users (closed loop), else 256
    prefill_chunk: int | None = 256  # most prompt tokens fed between two steps (EngineConfig.prefill_chunk)

    def __post_init__(self) -> None:
        if (self.users > 0) == (self.rate > 0):
            raise ValueError("give either users > 0 (closed loop) or rate > 0 (Poisson arrivals)")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests or duration_s")
        if not self.lengths or any(p < 1 or o < 1 for p, o in self.lengths):
            raise ValueError("lengths need prompt and output tokens >= 1")

    @property
    def load(self) -> float:
        return self.users if self.users > 0 else self.rate


@dataclass
class SimResult:
    policy: str
    load: float
    closed_loop: bool
    wall_s: float
    tokens: int  # tokens generated in the measured window
    latencies: list[tuple[int, float]] = field(default_factory=list)  # (tokens, latency) of measured requests
    steps: int = 0
    request_steps: int = 0
    verified: int = 0
    accepted: int = 0
    committed: int = 0

    def row(self) -> dict:
        """A result row with ``dspark bench serve``'s keys (``concurrency`` is the load)."""
        n = self.request_steps
        return {
            "policy": self.policy,
            "concurrency": self.load,
            "requests": len(self.latencies),
            "errors": 0,
            "wall_s": self.wall_s,
            "completion_tokens": self.tokens,
            "total_tokens_per_s": self.tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "user_tokens_per_s": statistics.fmean(t / lat for t, lat in self.latencies) if self.latencies else 0.0,
            "mean_latency_s": statistics.fmean(lat for _, lat in self.latencies) if self.latencies else None,
            "avg_verify_len": self.verified / n if n else None,
            "acceptance_length": self.committed / n if n else None,
            "avg_batch_size": n / self.steps if self.steps else None,
        }


def simulate(policy: str | ConfidenceAdapter, stats: DrafterStats, clock: StepClock, workload: Workload,
             seed: int = 0, fallback_confidence: float = 1.0, sps_for_policy: SPSTable | None = None) -> SimResult:
    """Run one (policy, load) point. ``policy`` is a ``--policy`` name (built with the production
    ``make_policy`` on ``sps_for_policy``, default the clock's verify table) or a ready adapter."""
    adapter = policy if isinstance(policy, ConfidenceAdapter) else make_policy(
        policy, sps_for_policy or clock.verify, None, fallback_confidence)
    name = policy if isinstance(policy, str) else adapter.name
    rng = np.random.default_rng(seed)
    sampler = DraftSampler(stats)
    if workload.domains is not None and (not workload.domains or not all(
            0 <= d < len(sampler.names) for d in workload.domains)):
        raise StatsError(f"workload domains must index the {len(sampler.names)} statistics domains")
    closed = workload.users > 0
    max_batch = workload.max_batch or (workload.users if closed else 256)
    limit = workload.num_requests
    t_end = workload.duration_s or math.inf
    warm = workload.warmup_s if workload.duration_s else 0.0
    res = SimResult(name, workload.load, closed, 0.0, 0)
    lengths = np.array(workload.lengths, dtype=np.int64)  # (L, 2) prompt, output
    # requests as columns indexed by request id: submit time and prompt tokens in lists; output tokens, domain and
    # generated tokens in NumPy arrays (grown by doubling), which the batch gathers each step
    submit, prompt = [], []
    output = np.zeros(1024, dtype=np.int64)  # (capacity,)
    domain = np.zeros(1024, dtype=np.int64)  # (capacity,)
    generated = np.zeros(1024, dtype=np.int64)  # (capacity,)
    waiting: deque[int] = deque()
    active = np.zeros(0, dtype=np.int64)  # (R,) request ids in the batch
    prefilling: list[int] = []  # admitted, prompt not yet complete
    fed: dict[int, int] = {}  # prompt tokens prefilled so far

    def new_request(t: float) -> None:
        nonlocal generated, output, domain
        rid = len(submit)
        if rid == len(generated):
            generated, output, domain = (np.concatenate([a, np.zeros_like(a)]) for a in (generated, output, domain))
        submit.append(t)
        prompt.append(int(lengths[rid % len(lengths), 0]))
        output[rid] = lengths[rid % len(lengths), 1]
        picked = workload.domains
        domain[rid] = picked[rid % len(picked)] if picked else sampler.draw_domains(1, rng)[0]
        waiting.append(rid)

    for _ in range(min(workload.users, limit or workload.users) if closed else 0):
        new_request(0.0)
    next_arrival = math.inf if closed else rng.exponential(1.0 / workload.rate)
    t, finished = 0.0, 0

    def retire(rids: list[int], now: float) -> None:
        nonlocal finished
        for rid in rids:
            finished += 1
            if submit[rid] >= warm and now <= t_end:
                res.latencies.append((int(generated[rid]), now - submit[rid]))
            if closed and (limit is None or len(submit) < limit):
                new_request(now)

    while t < t_end and (limit is None or finished < limit):
        while next_arrival <= t and (limit is None or len(submit) < limit):  # Poisson arrivals up to now
            new_request(next_arrival)
            next_arrival += rng.exponential(1.0 / workload.rate)
        while waiting and submit[waiting[0]] <= t and len(active) + len(prefilling) < max_batch:
            rid = waiting.popleft()
            prefilling.append(rid)
            fed[rid] = 0
        admitted = []
        if prefilling:  # one prefill chunk, oldest request first
            # disaggregated prefill (clock.prefill_enabled False) is not this engine's work: no chunk limit
            chunked = workload.prefill_chunk if clock.prefill_enabled else None
            budget = chunked or sum(prompt[r] - fed[r] for r in prefilling)
            chunk = 0
            for rid in list(prefilling):
                take = min(prompt[rid] - fed[rid], budget - chunk)
                if take <= 0:
                    break
                fed[rid] += take
                chunk += take
                if fed[rid] == prompt[rid]:
                    prefilling.remove(rid)
                    admitted.append(rid)
            t += clock.prefill_s(chunk)
            for r in admitted:  # a complete prompt gives the first token
                generated[r] = 1
            if warm <= t <= t_end:
                res.tokens += len(admitted)
            retire([r for r in admitted if output[r] <= 1], t)
            active = np.concatenate([active, [r for r in admitted if output[r] > 1]]).astype(np.int64)
        if len(active):
            gen = generated[active]  # (R,)
            left = output[active] - gen  # (R,)
            t, new = _step(domain[active], left, sampler, adapter, clock, stats.block_size, rng, res, t)
            if warm <= t <= t_end:
                res.tokens += int(new.sum())
            generated[active] = gen + new
            done = new >= left
            retire(active[done].tolist(), t)
            active = active[~done]
        elif not admitted and not prefilling:  # idle: jump to the next arrival
            pending = min(([submit[waiting[0]]] if waiting else []) + [next_arrival])
            if pending == math.inf:
                break
            t = max(t, pending)
    res.wall_s = (min(t, t_end) - warm) if workload.duration_s else t
    return res


def _step(domains: np.ndarray, left: np.ndarray, sampler: DraftSampler, adapter: ConfidenceAdapter,
          clock: StepClock, K: int, rng: np.random.Generator, res: SimResult, t: float) -> tuple[float, np.ndarray]:
    """One speculative step for requests of ``domains`` (R,) with ``left`` (R,) tokens still to generate;
    returns the clock after it and the tokens each request committed (R,)."""
    R = len(domains)
    num_tokens, confidences, accepted = sampler.draw(domains, rng)  # (R,), (R, K) | None, (R, K)
    logits = None
    if confidences is not None:  # logit(c): the adapter's sigmoid (no STS: c is already calibrated) gives c back
        c = np.clip(confidences, _EPS, 1 - _EPS)
        logits = torch.from_numpy(np.log(c) - np.log1p(-c))  # (R, K)
    block = DraftBlock(tokens=torch.zeros(R, K, dtype=torch.long), num_tokens=torch.from_numpy(num_tokens),
                       draft_probs=torch.zeros(R, K, 1), confidence_logits=logits)
    verify_len = adapter.verify_len(block).numpy()  # (R,) the production policy decides
    verified = np.arange(K)[None, :] < verify_len[:, None]  # (R, K)
    num_accepted = np.cumprod(accepted & verified, axis=1).sum(1)  # (R,) leading run among the verified
    new = np.minimum(num_accepted + 1, left)  # accepted + recovered/bonus token, cut at the output length
    res.steps += 1
    res.request_steps += R
    res.verified += int(verify_len.sum())
    res.accepted += int(np.minimum(num_accepted, new).sum())
    res.committed += int(new.sum())
    return t + clock.verify_s(int(R + verify_len.sum())), new
