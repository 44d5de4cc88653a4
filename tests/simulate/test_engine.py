"""The simulated engine on hand-computable cases, and the production policies deciding inside it."""

from __future__ import annotations

import pytest
import torch

from dspark.scheduler import policies
from dspark.scheduler.adapter import make_policy
from dspark.scheduler.sps import SPSTable
from dspark.simulate.engine import StepClock, Workload, simulate
from dspark.simulate.stats import KIND, stats_from_dict

K = 3
FLAT = SPSTable((1,), (10.0,), 1000)  # every step 0.1 s whatever its size


def drafter(accept: float, bins: list | None = None, proposal: list | None = None):
    return stats_from_dict({"kind": KIND, "name": "t", "block_size": K, "domains": {"d": {
        "proposal_lengths": proposal or [0, 0, 0, 1], "conditional_acceptance": [accept] * K,
        "confidence_bins": bins}}})


def one_user(policy: str, accept: float, output: int = 9) -> dict:
    clock = StepClock(FLAT, prefill_enabled=False)
    work = Workload(users=1, num_requests=1, lengths=((5, output),))
    return simulate(policy, drafter(accept), clock, work).row()


def test_one_user_all_accepted_commits_verify_len_plus_one_per_step() -> None:
    # prefill gives token 1; fixed:2 commits 3 per step: 3 + 3 + 2 (cut at 9) = 3 steps of 0.1 s
    row = one_user("fixed:2", 1.0)
    assert row["wall_s"] == pytest.approx(0.3)
    assert row["completion_tokens"] == 9
    assert row["total_tokens_per_s"] == pytest.approx(30.0)
    assert row["user_tokens_per_s"] == pytest.approx(30.0)
    assert row["avg_verify_len"] == pytest.approx(2.0)
    assert row["acceptance_length"] == pytest.approx(8 / 3)


def test_one_user_nothing_accepted_is_one_token_per_step() -> None:
    row = one_user("all", 0.0)
    assert row["wall_s"] == pytest.approx(0.8)  # 8 tokens after the prefill's first, one per step
    assert row["acceptance_length"] == pytest.approx(1.0)
    assert row["avg_verify_len"] == pytest.approx(K)


def test_prefill_time_comes_from_the_table_and_extrapolates() -> None:
    table = SPSTable((1, 4), (10.0, 5.0), 8)
    clock = StepClock(table)
    assert clock.prefill_s(4) == pytest.approx(0.2)
    assert clock.prefill_s(8) == pytest.approx(8 / (4 * 5.0))  # beyond the samples: seconds per token x P
    work = Workload(users=1, num_requests=1, lengths=((4, 3),))
    row = simulate("fixed:0", drafter(1.0), clock, work).row()
    assert row["wall_s"] == pytest.approx(0.2 + 2 * 0.1)  # prefill, then two 1-token steps


def test_chunked_prefill_feeds_a_long_prompt_over_several_iterations() -> None:
    flat16 = StepClock(SPSTable((1, 16), (10.0, 10.0), 1000))  # 0.1 s per step up to 16 tokens
    work = Workload(users=1, num_requests=1, lengths=((10, 2),), prefill_chunk=4)
    row = simulate("fixed:0", drafter(1.0), flat16, work).row()
    assert row["wall_s"] == pytest.approx(3 * 0.1 + 0.1)  # chunks of 4, 4, 2 tokens, then one decode step
    whole = simulate("fixed:0", drafter(1.0), flat16, Workload(users=1, num_requests=1,
                     lengths=((10, 2),), prefill_chunk=None)).row()
    assert whole["wall_s"] == pytest.approx(0.2)
    elsewhere = simulate("fixed:0", drafter(1.0), StepClock(FLAT, prefill_enabled=False), work).row()
    assert elsewhere["wall_s"] == pytest.approx(0.1)  # disaggregated prefill: no chunks, no cost


def test_closed_loop_users_share_steps_and_poisson_jumps_when_idle() -> None:
    clock = StepClock(FLAT, prefill_enabled=False)
    two = simulate("fixed:2", drafter(1.0), clock, Workload(users=2, num_requests=2, lengths=((5, 9),))).row()
    assert two["wall_s"] == pytest.approx(0.3) and two["total_tokens_per_s"] == pytest.approx(60.0)
    assert two["avg_batch_size"] == pytest.approx(2.0)
    sparse = simulate("fixed:2", drafter(1.0), clock, Workload(rate=0.01, num_requests=3, lengths=((5, 9),)))
    assert sparse.wall_s > 10  # arrivals 100 s apart on average: the clock jumps, requests never overlap
    assert sparse.row()["avg_batch_size"] == pytest.approx(1.0)


def test_prompt_lookup_style_proposals_limit_what_is_verified() -> None:
    row = simulate("all", drafter(1.0, proposal=[1, 0, 0, 0]), StepClock(FLAT, prefill_enabled=False),
                   Workload(users=1, num_requests=1, lengths=((5, 4),))).row()
    assert row["avg_verify_len"] == 0 and row["wall_s"] == pytest.approx(0.3)


def test_a_policy_change_changes_the_simulation() -> None:
    assert one_user("fixed:1", 1.0)["wall_s"] != one_user("fixed:3", 1.0)["wall_s"]


def test_the_production_policy_objects_decide(monkeypatch) -> None:
    calls = []

    def never_verify(self, confidences, num_candidates):
        calls.append(confidences.shape)
        return torch.zeros_like(num_candidates)

    monkeypatch.setattr(policies.GreedyPrefixScheduler, "choose", never_verify)
    bins = [[[0.5, 1.0, 0.5]]] * K
    row = simulate("alg1", drafter(0.5, bins), StepClock(FLAT, prefill_enabled=False),
                   Workload(users=2, num_requests=2, lengths=((5, 6),))).row()
    assert row["avg_verify_len"] == 0 and calls and calls[0] == (2, K)


def test_a_ready_adapter_gets_the_calibrated_confidences() -> None:
    seen = []

    class Spy:
        requires_confidences = True

        def choose(self, confidences, num_candidates):
            seen.append(confidences.clone())
            return num_candidates

    bins = [[[0.2, 1.0, 0.2], [0.9, 1.0, 0.9]]] * K
    adapter = make_policy("all")
    adapter.policy = Spy()
    simulate(adapter, drafter(0.55, bins), StepClock(FLAT, prefill_enabled=False),
             Workload(users=4, num_requests=8, lengths=((5, 6),)))
    values = torch.cat(seen).flatten().unique()
    assert torch.allclose(values, torch.tensor([0.2, 0.9], dtype=torch.float64))


def test_verify_budget_falls_as_load_rises_on_a_stepped_table() -> None:
    # flat up to 8 batch tokens, then every further 8 tokens cost a quarter step more (Fig. 8's shape)
    grid = list(range(1, 257))
    table = SPSTable(grid, [100.0 / (1 + 0.25 * ((b + 7) // 8 - 1)) for b in grid], 256)
    bins = [[[0.3, 0.3, 0.3], [0.7, 0.4, 0.7], [0.95, 0.3, 0.95]]] * K
    stats = drafter(0.3 * 0.3 + 0.4 * 0.7 + 0.3 * 0.95, bins)
    budget = []
    for users in (1, 4, 12, 32):
        work = Workload(users=users, duration_s=20, lengths=((5, 40),))
        budget.append(simulate("alg1", stats, StepClock(table, prefill_enabled=False), work, seed=1).row()
                      ["avg_verify_len"])
    assert budget[0] > 2.5 and budget[-1] < 1.0 and all(a >= b for a, b in zip(budget, budget[1:])), budget
    # negative control: on a flat table nothing makes verification costlier as load grows
    flat = [simulate("alg1", stats, StepClock(FLAT, prefill_enabled=False),
                     Workload(users=u, duration_s=20, lengths=((5, 40),)), seed=1).row()["avg_verify_len"]
            for u in (1, 32)]
    assert flat[0] == pytest.approx(flat[1])
