"""The asynchronous scheduler's draft gate on synthetic steps with the noise of real ones (docs/serving/step-cost.md
§Skipping the drafter).

A plain step of R requests commits R tokens in ``PLAIN_S`` (+-3 %); a drafting step commits, per request, 1 + the
accepted drafts of ``DRAFTS``, each accepted with probability ``ACCEPTANCE`` once the one before was, in the time that
makes drafting ``gain`` times a plain step's rate (+-5 %). Such steps commit 1 to 1 + K tokens per request, so a
window of a few of them measures drafting's rate loosely, as in the engine. ``gate_efficiency`` runs a gate
(``AsyncTopKScheduler.should_draft`` / ``observe_step``) over them and returns the rate it reached over the better
kind's: 1.0 = it always chose the faster kind. With ``churn`` the request count moves as a served level's does when
clients come and go: by one request in that share of the steps, within the top quarter of its range (at least one
request below the top), and the gate keeps its rates per request count as in the engine.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from dspark.scheduler.policies import AsyncTopKScheduler
from dspark.scheduler.step_cost import CostCurve, StepCostModel

PLAIN_S = 0.020
DRAFTS = 4
ACCEPTANCE = 0.55


def synthetic_gate(draft_ms: float = 1.0) -> AsyncTopKScheduler:
    """A gate whose cost model (verify_ms(B) = 10 + 2B, drafting ``draft_ms``) has seen one step of one request
    with survivals .9 .8 .7 .6 .5 .4: it decides from the model until it has measured both kinds of step."""
    grid = tuple(range(1, 65))
    cost = StepCostModel(CostCurve(grid, tuple(10.0 + 2.0 * b for b in grid)), 64,
                         draft=CostCurve((1,), (draft_ms,)))
    gate = AsyncTopKScheduler(cost, lag=1)
    gate.should_draft(1)
    gate.choose(torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]], dtype=torch.float64), torch.tensor([6]))
    return gate


def drafting_tokens(requests: int, rng: random.Random) -> int:
    """Tokens one drafting step commits over ``requests`` requests: each 1 (the bonus) + its accepted prefix."""
    total = 0
    for _ in range(requests):
        accepted = 0
        while accepted < DRAFTS and rng.random() < ACCEPTANCE:
            accepted += 1
        total += 1 + accepted
    return total


def churn_range(requests: int) -> tuple[int, int]:
    """The request counts a level of ``requests`` clients moves between under churn: the top quarter of 1..requests,
    at least one below the top (a client's next request is in its prompt while the others decode)."""
    return max(1, requests - max(1, requests // 4)), requests


def gate_efficiency(make_gate: Callable[[], AsyncTopKScheduler], gain: float, requests: int, seed: int,
                    steps: int = 600, warmup: int = 100, churn: float = 0.0) -> float:
    """The rate of a fresh gate's steps after the first ``warmup`` of ``steps``, over the better kind's rate at each
    step's request count (``requests``, or a count of ``churn_range`` moving by one in ``churn`` of the steps)."""
    rng = random.Random(seed)
    gate = make_gate()
    low, high = churn_range(requests)
    R = requests
    ideal_s = seconds = 0.0
    for i in range(steps):
        if churn > 0 and rng.random() < churn:
            R = min(high, max(low, R + rng.choice((-1, 1))))
        drafted = gate.should_draft(R)
        plain_rate = R / PLAIN_S  # tokens per second of plain steps, and of drafting steps times gain
        if drafted:
            mean_tokens = R * sum(ACCEPTANCE ** k for k in range(DRAFTS + 1))
            t, s = drafting_tokens(R, rng), mean_tokens / (plain_rate * gain) * rng.uniform(0.95, 1.05)
        else:
            t, s = R, PLAIN_S * rng.uniform(0.97, 1.03)
        gate.observe_step(R, drafted, t, s)
        if i >= warmup:
            ideal_s, seconds = ideal_s + t / (plain_rate * max(gain, 1.0)), seconds + s
    return ideal_s / seconds
