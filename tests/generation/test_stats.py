"""Acceptance statistics of the decoding loop: hand-computed summaries, merging, JSON, simulated rates."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dspark.generation.stats import AcceptanceStats

# Four steps with block_size 3, as (proposal_len, num_accepted, acceptance_length):
# a partial accept, a full accept with bonus, a rejection at draft 0, and an EOS stop.
STEPS = [(3, 1, 2), (3, 3, 4), (2, 0, 1), (1, 1, 1)]


def make_stats() -> AcceptanceStats:
    stats = AcceptanceStats(block_size=3)
    for step in STEPS:
        stats.add_step(*step)
    return stats


def test_acceptance_summaries_by_hand():
    stats = make_stats()
    assert stats.num_steps == 4
    assert stats.num_proposed == 9 and stats.num_accepted == 5
    assert stats.acceptance_length == pytest.approx(8 / 4)  # tau = (2 + 4 + 1 + 1) / 4
    assert stats.mean_proposal_len == pytest.approx(9 / 4)
    assert stats.verify_rate == pytest.approx(8 / (9 + 4))
    # prefix: #(acc > k) / #(proposal_len > k)
    assert stats.prefix_acceptance_curve() == pytest.approx([3 / 4, 1 / 3, 1 / 2])
    # conditional: #(acc > k) / #(acc >= k and proposal_len > k)
    #   k=1: steps (3,1), (3,3) reached draft 1; only (3,3) accepted it
    #   k=2: step (3,1) stopped before draft 2, so only (3,3) counts
    assert stats.per_position_acceptance() == pytest.approx([3 / 4, 1 / 2, 1.0])


def test_acceptance_empty_and_unreached_positions_are_nan():
    stats = AcceptanceStats(block_size=2)
    assert math.isnan(stats.acceptance_length) and math.isnan(stats.verify_rate)
    stats.add_step(1, 0, 1)
    assert stats.prefix_acceptance(0) == 0.0
    assert math.isnan(stats.prefix_acceptance(1)) and math.isnan(stats.conditional_acceptance(1))
    with pytest.raises(ValueError, match="position"):
        stats.prefix_acceptance(2)


def test_add_steps_and_merge_match_add_step():
    one_by_one = make_stats()
    batched = AcceptanceStats(block_size=3)
    proposal, accepted, length = (torch.tensor(col) for col in zip(*STEPS))
    batched.add_steps(proposal, accepted, length)
    assert batched == one_by_one

    first, second = AcceptanceStats(block_size=3), AcceptanceStats(block_size=3)
    for step in STEPS[:2]:
        first.add_step(*step)
    for step in STEPS[2:]:
        second.add_step(*step)
    first.merge(second)
    assert first == one_by_one
    with pytest.raises(ValueError, match="block_size"):
        first.merge(AcceptanceStats(block_size=4))


def test_acceptance_dict_round_trip_through_json():
    stats = make_stats()
    text = json.dumps(AcceptanceStats(block_size=3).to_dict(), allow_nan=False)  # strict JSON when empty
    assert json.loads(text)["prefix_acceptance"] == [None, None, None]
    restored = AcceptanceStats.from_dict(json.loads(json.dumps(stats.to_dict(), allow_nan=False)))
    assert restored == stats
    assert restored.to_dict()["verify_rate"] == pytest.approx(8 / 13)
    with pytest.raises(ValueError, match="unknown"):
        AcceptanceStats.from_dict({**stats.to_dict(), "tau": 2.0})
    with pytest.raises(ValueError, match="missing"):
        AcceptanceStats.from_dict({"block_size": 3})


@pytest.mark.parametrize(
    "step",
    [(4, 0, 1), (2, 3, 4), (-1, 0, 1), (2, 1, 3), (2, 1, 0), (2, 0, 0)],
    ids=["over-block", "accepted>proposed", "negative", "length-too-big", "length-too-small", "empty-step"],
)
def test_add_step_rejects_inconsistent_steps(step):
    with pytest.raises(ValueError):
        AcceptanceStats(block_size=3).add_step(*step)
    with pytest.raises(ValueError):
        AcceptanceStats(block_size=3).add_steps(*([x] for x in step))


def test_conditional_and_prefix_acceptance_recover_simulated_rates():
    """Drafts accepted with known conditional rates; prefix rates are their running products."""
    rng = np.random.default_rng(0)
    cond = np.array([0.9, 0.7, 0.5])
    n = 20_000
    proposal = rng.integers(0, 4, size=n)  # random truncation of the proposal
    flags = rng.random((n, 3)) < cond  # (N, K)
    num_accepted = np.minimum(np.cumprod(flags, axis=1).sum(axis=1), proposal)
    stats = AcceptanceStats(block_size=3)
    stats.add_steps(proposal, num_accepted, num_accepted + 1)
    # binomial standard error <= sqrt(0.25 / 2000) ~ 0.011 at the rarest position; bound = 4 SE
    assert np.abs(np.array(stats.per_position_acceptance()) - cond).max() < 0.045
    assert np.abs(np.array(stats.prefix_acceptance_curve()) - np.cumprod(cond)).max() < 0.045
    # negative control: the prefix curve is not the conditional one
    assert abs(stats.prefix_acceptance(2) - cond[2]) > 0.1  # 0.315 vs 0.5


def test_prefix_is_product_of_conditionals_when_all_drafts_verified():
    stats = AcceptanceStats(block_size=3)
    for num_accepted, repeats in ((0, 3), (1, 2), (2, 4), (3, 1)):
        for _ in range(repeats):
            stats.add_step(3, num_accepted, num_accepted + 1)
    assert stats.prefix_acceptance_curve() == pytest.approx(np.cumprod(stats.per_position_acceptance()))
