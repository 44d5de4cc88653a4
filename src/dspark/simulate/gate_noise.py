"""The asynchronous scheduler's draft gate on synthetic steps with the noise of real ones (docs/serving/step-cost.md
§Skipping the drafter).

A plain step of R requests commits R tokens in ``PLAIN_S`` (+-3 %); a drafting step commits, per request, 1 + the
accepted drafts of ``DRAFTS``, each accepted with probability ``ACCEPTANCE`` once the one before was, in the time that
makes drafting ``gain`` times a plain step's rate (+-5 %). Such steps commit 1 to 1 + K tokens per request, so a
window of a few of them measures drafting's rate loosely, as in the engine. ``gate_efficiency`` runs a gate
(``AsyncTopKScheduler.should_draft`` / ``observe_step``) over them and returns the rate it reached over the better
kind's: 1.0 = it always chose the faster kind.
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


def gate_efficiency(make_gate: Callable[[], AsyncTopKScheduler], gain: float, requests: int, seed: int,
                    steps: int = 600, warmup: int = 100) -> float:
    """The rate of a fresh gate's steps after the first ``warmup`` of ``steps``, over max(drafting, plain)'s rate."""
    rng = random.Random(seed)
    gate = make_gate()
    mean_tokens = requests * sum(ACCEPTANCE ** k for k in range(DRAFTS + 1))
    plain_rate = requests / PLAIN_S
    drafting_s = mean_tokens / (plain_rate * gain)
    tokens = seconds = 0.0
    for i in range(steps):
        drafted = gate.should_draft(requests)
        if drafted:
            t, s = drafting_tokens(requests, rng), drafting_s * rng.uniform(0.95, 1.05)
        else:
            t, s = requests, PLAIN_S * rng.uniform(0.97, 1.03)
        gate.observe_step(requests, drafted, t, s)
        if i >= warmup:
            tokens, seconds = tokens + t, seconds + s
    return tokens / seconds / (plain_rate * max(gain, 1.0))
