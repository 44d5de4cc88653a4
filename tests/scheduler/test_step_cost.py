"""The whole-step cost model: its file format and conversions, and alg1 / async planning on it against a
brute-force enumeration of plans."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

from dspark.drafters.base import RequestState
from dspark.errors import BadFileError
from dspark.scheduler.adapter import make_policy
from dspark.sampling.processing import SamplingParams
from dspark.scheduler.policies import AsyncTopKScheduler, GreedyPrefixScheduler, RetrospectiveGlobalSearch
from dspark.scheduler.sps import SPSTable
from dspark.scheduler.step_cost import CostCurve, StepCostModel, as_step_cost


def conf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def counts(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def linear_verify(max_tokens: int, base_ms: float, per_token_ms: float) -> CostCurve:
    """verify_ms(B) = base + per_token * B at every B = 1..max_tokens."""
    grid = tuple(range(1, max_tokens + 1))
    return CostCurve(grid, tuple(base_ms + per_token_ms * b for b in grid))


# ------------------------------------------------------------------ format
def test_json_round_trip_and_lookup() -> None:
    model = StepCostModel(CostCurve((4, 8), (10.0, 14.0)), 12, CostCurve((1, 2), (3.0, 5.0)),
                          CostCurve((1, 3), (0.5, 1.5)), {"target": "tiny", "threads": 1, "block_size": 3})
    data = json.loads(model.to_json())
    assert data["format"] == "dspark-step-cost" and data["version"] == 1 and data["units"] == "ms"
    assert data["verify"] == {"batch_tokens": [4, 8], "ms": [10.0, 14.0], "max_batch_tokens": 12}
    back = StepCostModel.from_dict(data)
    assert back == model and back.profile == model.profile
    # floor steps, clamped at both ends; beyond max_batch_tokens a step cannot run
    assert model.step_ms(3, 1) == 10.0 + 3.0 + 0.5
    assert model.step_ms(9, 2, num_drafting=2) == 14.0 + 5.0 + 0.5  # host(2) = host(1): floor
    assert model.step_ms(12, 5, num_drafting=0) == 14.0 + 1.5  # nobody drafted; host clamps at its last sample
    assert math.isinf(model.step_ms(13, 1))
    assert model.throughput_array([2.0], [13], 1)[0] == 0.0


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "version"),
    ({"units": "s"}, "units"),
    ({"format": "other"}, "format"),
    ({"extra": 1}, "unknown"),
    ({"verify": {"batch_tokens": [4, 8], "ms": [1.0, 0.0], "max_batch_tokens": 8}}, "> 0"),
    ({"verify": {"batch_tokens": [8, 4], "ms": [1.0, 2.0], "max_batch_tokens": 8}}, "increasing"),
    ({"verify": {"batch_tokens": [4, 8], "ms": [1.0, 2.0], "max_batch_tokens": 4}}, "max_batch_tokens"),
    ({"draft": {"requests": [1], "ms": [-1.0]}}, ">= 0"),
    ({"host": {"requests": [1], "ms": [1.0], "per": 2}}, "exactly the keys"),
    ({"profile": {"gpu": "h100"}}, "unknown profile key"),
    ({"profile": {"threads": "two"}}, "int"),
])
def test_bad_step_cost_files_are_refused(tmp_path, change, message) -> None:
    data = StepCostModel(CostCurve((4, 8), (10.0, 14.0)), 8).to_dict() | change
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BadFileError, match=message):
        StepCostModel.load(path)
    with pytest.raises(BadFileError, match="does not exist"):
        StepCostModel.load(tmp_path / "missing.json")


def test_host_work_is_priced_by_the_batch_s_share_of_greedy_requests(tmp_path) -> None:
    model = StepCostModel(CostCurve((4, 8), (10.0, 14.0)), 12, CostCurve((1, 2), (3.0, 5.0)),
                          CostCurve((1, 2), (8.0, 20.0)), {}, CostCurve((1, 2), (2.0, 4.0)))
    assert model.for_batch(0.0).host == model.host and model.for_batch(0.0).host_greedy is None
    assert model.for_batch(1.0).host.ms == (2.0, 4.0)
    assert model.for_batch(0.25).step_ms(8, 2, 2) == pytest.approx(14.0 + 5.0 + 0.75 * 20.0 + 0.25 * 4.0)
    path = tmp_path / "cost.json"
    model.save(path)
    assert StepCostModel.load(path) == model and json.loads(path.read_text())["host_greedy"]["ms"] == [2.0, 4.0]
    plain = StepCostModel(model.verify, 12, model.draft, model.host)
    assert plain.for_batch(1.0) is plain and "host_greedy" not in plain.to_dict()
    with pytest.raises(ValueError, match="grid"):
        StepCostModel(model.verify, 12, model.draft, model.host, {}, CostCurve((1, 3), (2.0, 4.0)))
    data = model.to_dict()
    del data["host"]
    with pytest.raises(ValueError, match="needs host"):
        StepCostModel.from_dict(data)


def test_async_plans_a_greedy_batch_on_its_cheaper_host_work() -> None:
    # host work is a large fixed part of a sampled step (60 ms), a small one of a greedy step (1 ms): with it the
    # planner verifies more drafts (each costs little beside the fixed part); a greedy batch gets fewer
    cost = StepCostModel(linear_verify(64, 10.0, 2.0), 64, CostCurve((1,), (4.0,)), CostCurve((1, 2), (30.0, 60.0)),
                         {}, CostCurve((1, 2), (0.5, 1.0)))
    c = conf([[0.6, 0.4, 0.3, 0.3, 0.3, 0.3, 0.3], [0.5, 0.4, 0.3, 0.3, 0.2, 0.2, 0.2]])
    policy = AsyncTopKScheduler(cost, lag=1)
    policy.choose(c, counts([7, 7]))
    sampled = policy.capacity(2, 2)
    policy.greedy_share = 1.0
    greedy = policy.capacity(2, 2)
    assert greedy < sampled
    # the same as planning on a model whose host work is the greedy curve
    alone = AsyncTopKScheduler(StepCostModel(cost.verify, 64, cost.draft, cost.host_greedy), lag=1)
    alone.choose(c, counts([7, 7]))
    assert alone.capacity(2, 2) == greedy


def test_a_filled_curve_is_linear_between_measured_counts() -> None:
    draft = CostCurve((1, 2, 4, 8), (3.0, 4.0, 6.0, 14.0)).filled()
    assert draft.grid == tuple(range(1, 9))
    assert [draft.at(r) for r in range(1, 10)] == pytest.approx([3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 14.0, 14.0])
    verify = CostCurve((4, 8), (10.0, 14.0), positive=True).filled()
    assert verify.positive and verify.at(1) == 10.0 and verify.at(6) == pytest.approx(12.0)


def test_plain_sps_file_loads_as_a_verify_only_model(tmp_path) -> None:
    table = SPSTable((8, 16, 24), (50.0, 40.0, 25.0), 32)
    path = tmp_path / "sps.json"
    table.save(path)
    model = StepCostModel.load(path)
    assert model.verify_only and model.max_batch_tokens == 32
    assert model.verify.ms == (20.0, 25.0, 40.0)
    assert model.to_sps_table() == table  # the exact inverse
    assert as_step_cost(table) == model


def test_whole_step_sps_table_on_sglangs_grid() -> None:
    # gamma 3: B = 4 is one request, B = 8 two; each step adds their drafting and host work
    model = StepCostModel(CostCurve((4, 8), (10.0, 14.0)), 8, CostCurve((1, 2), (5.0, 6.0)),
                          CostCurve((1, 2), (1.0, 2.0)), {"block_size": 3})
    whole = model.to_sps_table(whole_step=True)
    assert whole.sample_batch_tokens == (4, 8)
    assert whole.sample_steps_per_sec == pytest.approx((1000 / 16.0, 1000 / 22.0))
    with pytest.raises(ValueError, match="block size"):
        StepCostModel(CostCurve((4,), (1.0,)), 4).to_sps_table(whole_step=True)


def test_sglang_additive_table_round_trip() -> None:
    # dense grids: SGLang's linear interpolation and our floor step agree at every integer
    model = StepCostModel(linear_verify(12, 8.0, 0.5), 12, CostCurve((1, 2, 3), (2.0, 2.5, 3.0)),
                          CostCurve((1, 2, 3), (1.0, 1.2, 1.4)))
    additive = model.to_additive()
    assert set(additive) == {"bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds"}
    back = StepCostModel.from_dict(additive)
    for b in range(1, 13):
        for r in range(1, 4):
            assert back.step_ms(b, r) == pytest.approx(model.step_ms(b, r))
    # sparse probes are interpolated as SGLang does: 10 ms at 1 token, 20 ms at 11 -> 15 ms at 6
    sparse = StepCostModel.from_dict({"bias_seconds": 0.001, "bs_probes": [1, 3], "alpha_seconds": [0.0, 0.002],
                                      "m_probes": [1, 11], "theta_seconds": [0.010, 0.020]})
    assert sparse.step_ms(6, 2) == pytest.approx(15.0 + 1.0 + 1.0)
    with pytest.raises(ValueError, match="exactly the keys"):
        StepCostModel.from_dict({"bias_seconds": 0.0, "bs_probes": [1], "alpha_seconds": [0.0], "m_probes": [1]})


# --------------------------------------------------------------- planning
def _throughput(c: list[list[float]], n: list[int], lengths: list[int], model: StepCostModel) -> float:
    """Theta of one plan, written out: expected committed tokens over the whole step's seconds."""
    R = len(c)
    tau = sum(1 + sum(math.prod(c[r][: j + 1]) for j in range(lengths[r])) for r in range(R))
    drafting = sum(1 for x in n if x > 0)
    step_ms = model.verify.at(R + sum(lengths)) + model.host.at(R) + (model.draft.at(drafting) if drafting else 0)
    if R + sum(lengths) > model.max_batch_tokens:
        return 0.0
    return tau * 1000.0 / step_ms


def _all_plans(n: list[int]):
    return itertools.product(*(range(x + 1) for x in n))


def _greedy_reference(c: list[list[float]], n: list[int], model: StepCostModel) -> list[int]:
    """Algorithm 1 line by line, with the whole step's Theta (the early stop keeps it causal)."""
    R = len(c)
    a = [[math.prod(c[r][: j + 1]) for j in range(n[r])] for r in range(R)]
    E = sorted(((a[r][j], j, r) for r in range(R) for j in range(n[r]) if a[r][j] > 0),
               key=lambda e: (-e[0], e[1], e[2]))
    lengths = [0] * R
    best = _throughput(c, n, lengths, model)
    for _, j, r in E:
        lengths[r] = j + 1
        theta = _throughput(c, n, lengths, model)
        if theta <= best:
            lengths[r] = j
            break
        best = theta
    return lengths


def _random_case(rng: random.Random) -> tuple[list[list[float]], list[int], StepCostModel]:
    R, K = rng.randint(1, 4), rng.randint(1, 4)
    c = [[rng.choice([0.0, 0.5, 1.0, rng.random(), rng.random(), rng.random()]) for _ in range(K)] for _ in range(R)]
    n = [rng.randint(0, K) for _ in range(R)]
    grid = sorted(rng.sample(range(1, R * (K + 1) + 1), rng.randint(1, min(6, R * (K + 1)))))
    verify = CostCurve(tuple(grid), tuple(sorted(rng.uniform(1, 20) for _ in grid)))
    reqs = tuple(range(1, R + 1))
    draft = CostCurve(reqs, tuple(rng.choice([0.0, rng.uniform(0, 60)]) for _ in reqs))
    host = CostCurve(reqs, tuple(rng.uniform(0, 5) for _ in reqs))
    return c, n, StepCostModel(verify, grid[-1] + rng.randint(0, R), draft, host)


def test_planners_match_a_brute_force_enumeration_of_plans() -> None:
    rng = random.Random(1)
    differs = 0  # negative control: planning on the verify pass alone must choose differently in some cases
    for _ in range(300):
        c, n, model = _random_case(rng)
        c_t, n_t = conf(c), counts(n)
        verify_only = StepCostModel(model.verify, model.max_batch_tokens)
        differs += GreedyPrefixScheduler(verify_only).choose(c_t, n_t).tolist() != _greedy_reference(c, n, model)
        best_of_all = max(_throughput(c, n, list(plan), model) for plan in _all_plans(n))
        # the retrospective search (argmax along the survival path) reaches the best plan of all:
        # for a fixed number of verified drafts the cost is fixed and the top survivals maximise tau
        retro = RetrospectiveGlobalSearch(model).choose(c_t, n_t).tolist()
        assert _throughput(c, n, retro, model) == pytest.approx(best_of_all, rel=1e-12)
        # async sizes the batch by that search (lagged survivals = these ones after one step)
        policy = AsyncTopKScheduler(model, lag=1)
        policy.choose(c_t, n_t)
        assert policy.choose(c_t, n_t).tolist() == retro
        assert policy.last_capacity == sum(retro)
        # Algorithm 1 stops at its first admission that does not raise Theta
        assert GreedyPrefixScheduler(model).choose(c_t, n_t).tolist() == _greedy_reference(c, n, model)
    assert differs >= 10, differs  # 27 of the 300 with this seed


def test_zero_overhead_model_plans_as_the_sps_table() -> None:
    table = SPSTable((2, 3, 4, 5, 6), (1.0, 0.9, 0.8, 0.6, 0.55), 8)
    rng = random.Random(2)
    for _ in range(100):
        c = conf([[rng.random() for _ in range(3)] for _ in range(2)])
        n = counts([rng.randint(0, 3), rng.randint(0, 3)])
        model = StepCostModel.from_sps_table(table)
        assert GreedyPrefixScheduler(model).choose(c, n).tolist() == GreedyPrefixScheduler(table).choose(c, n).tolist()
        assert (RetrospectiveGlobalSearch(model).choose(c, n).tolist()
                == RetrospectiveGlobalSearch(table).choose(c, n).tolist())


def test_drafting_cost_makes_longer_verification_pay() -> None:
    # One request, c = .9 .8 .7 .6 .5 .4 (survival .9 .72 .504 .302 .151 .060); verify_ms(B) = 10 + 2B.
    c, n = conf([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]]), counts([6])
    target_only = StepCostModel(linear_verify(16, 10.0, 2.0), 16)
    # Theta(b) = tau / (10 + 2(1 + b)): 1/12, 1.9/14, 2.62/16, 3.124/18 = .1736, then 3.426/20 = .1713 stops: 3
    assert GreedyPrefixScheduler(target_only).choose(c, n).tolist() == [3]
    # drafting costs 40 ms a step: Theta(b) = tau / (50 + 2(1 + b)): ... 3.426/60 = .0571, 3.577/62 = .0577,
    # then 3.638/64 = .0568 stops: 5 drafts verified. The fixed part of the step makes a token relatively cheap.
    whole_step = StepCostModel(linear_verify(16, 10.0, 2.0), 16, draft=CostCurve((1,), (40.0,)))
    assert GreedyPrefixScheduler(whole_step).choose(c, n).tolist() == [5]
    for cost, expected in ((target_only, 3), (whole_step, 5)):  # the async capacity moves the same way
        policy = AsyncTopKScheduler(cost, lag=1)
        policy.choose(c, n)
        assert sum(policy.choose(c, n).tolist()) == expected
    # a request that proposed nothing did not draft: with no drafts at all the drafting cost is not paid
    assert whole_step.step_ms(1, 1, num_drafting=0) == target_only.step_ms(1, 1)


def test_per_request_host_work_moves_the_plan_of_a_batch() -> None:
    # Four requests; verify_ms(B) = 4 + 1 B. Host work of 5 ms per request adds 20 ms to every plan of this batch.
    c = conf([[0.8, 0.5, 0.5]] * 4)
    n = counts([3, 3, 3, 3])
    target_only = StepCostModel(linear_verify(16, 4.0, 1.0), 16)
    host = StepCostModel(linear_verify(16, 4.0, 1.0), 16, host=CostCurve((1, 2, 3, 4), (5.0, 10.0, 15.0, 20.0)))
    short = GreedyPrefixScheduler(target_only).choose(c, n).tolist()
    long = GreedyPrefixScheduler(host).choose(c, n).tolist()
    assert sum(long) > sum(short)
    assert short == [1, 1, 1, 1] and long == [2, 2, 2, 2]
    # the whole-step Theta ranks plans by tokens per second of the whole step: check the chosen ones by hand
    assert _throughput(c.tolist(), n.tolist(), long, host) > _throughput(c.tolist(), n.tolist(), short, host)
    assert _throughput(c.tolist(), n.tolist(), short, target_only) > _throughput(c.tolist(), n.tolist(), long,
                                                                                 target_only)


def test_make_policy_takes_a_step_cost_model() -> None:
    model = StepCostModel(linear_verify(16, 10.0, 2.0), 16, draft=CostCurve((1,), (40.0,)))
    adapter = make_policy("alg1", model)
    assert adapter.policy.cost is model
    assert make_policy("async", SPSTable.flat()).policy.cost.verify_only


# ------------------------------------------------------------------ the draft gate
# One request, c = .9 .8 .7 .6 .5 .4; verify_ms(B) = 10 + 2B. A plain step: 1 token in 12 ms (.0833 per ms).
GATE_C, GATE_N = conf([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]]), counts([6])


def _gate(draft_ms: float, **kwargs) -> AsyncTopKScheduler:
    policy = AsyncTopKScheduler(StepCostModel(linear_verify(64, 10.0, 2.0), 64, draft=CostCurve((1,), (draft_ms,))),
                                lag=1, **kwargs)
    assert policy.should_draft(1)  # no survivals seen yet: draft
    policy.choose(GATE_C, GATE_N)
    return policy


def test_async_drafts_only_where_drafting_beats_a_plain_step() -> None:
    # drafting 40 ms: the best drafting step is 3.577 tokens in 62 ms (.0577 per ms) < .0833: plain steps
    assert not _gate(40.0).should_draft(1)
    # drafting 1 ms: 3.124 tokens in 19 ms (.164 per ms) > .0833: draft
    assert _gate(1.0).should_draft(1)
    # no drafting cost in the model (an SPS table): the gate never skips
    table = AsyncTopKScheduler(StepCostModel(linear_verify(64, 10.0, 2.0), 64), lag=1)
    table.choose(GATE_C, GATE_N)
    assert table.should_draft(1)


def test_the_draft_bound_is_one_past_the_deepest_draft_the_capacity_admits() -> None:
    cost = StepCostModel(linear_verify(64, 10.0, 2.0), 64, CostCurve((1,), (4.0,)))
    policy = AsyncTopKScheduler(cost, lag=2)
    c = conf([[0.95, 0.9, 0.9, 0.5, 0.3, 0.2, 0.1], [0.6, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3]])
    n = counts([7, 7])
    assert policy.draft_bound(2, 2) is None  # no lagged pool yet: no bound
    policy.choose(c, n)
    assert policy.draft_bound(2, 2) is None
    policy.choose(c, n)
    # slow reference: K* by brute force over the lagged pool's prefixes, then the deepest of those entries
    survival = c.cumprod(1).flatten().tolist()  # request 0's positions 0..6, then request 1's
    entries = sorted(((a, j % 7, j // 7) for j, a in enumerate(survival)), key=lambda e: (-e[0], e[1], e[2]))
    rates = [(2 + sum(a for a, _, _ in entries[:b])) / (10.0 + 2.0 * (2 + b) + 4.0) for b in range(15)]
    best = max(range(15), key=lambda b: (rates[b], -b))
    assert policy.capacity(2, 2) == best and 0 < best < 14
    assert policy.draft_bound(2, 2) == max(j for _, j, _ in entries[:best]) + 2
    # a capacity of 0 still drafts one position: the survivals that could raise it keep coming
    stingy = AsyncTopKScheduler(StepCostModel(linear_verify(64, 1.0, 50.0), 64), lag=1)
    stingy.choose(c, n)
    assert stingy.capacity(2, 2) == 0 and stingy.draft_bound(2, 2) == 1
    stingy.reset()
    assert stingy.draft_bound(2, 2) is None


def test_a_step_proposes_no_deeper_than_the_draft_bound() -> None:
    from dspark.generation.step import prefill, speculative_step
    from dspark.scheduler.adapter import ConfidenceAdapter
    from tests.drafters.tiny_drafters import tiny_dspark
    from dspark.drafters.dspark.drafter import DSparkDrafter
    from tests.tiny import tiny_target

    target = tiny_target()
    drafter = DSparkDrafter(tiny_dspark(target))
    asked = []
    propose = drafter.propose
    drafter.propose = lambda requests, max_tokens: asked.append(list(max_tokens)) or propose(requests, max_tokens)
    policy = AsyncTopKScheduler(StepCostModel(linear_verify(64, 10.0, 30.0), 64), lag=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0)
    states = [RequestState(f"r{i}", 4, [3, 4, 5, 6 + i], params, params.make_generator()) for i in range(2)]
    caches = [target.new_cache(64) for _ in states]
    prefill(target, states, caches, drafter.target_layer_ids)
    adapter = ConfidenceAdapter(policy)
    bounds = []
    for _ in range(6):
        bounds.append(policy.draft_bound(2, 2))
        speculative_step(target, drafter, states, caches, adapter)
    assert bounds[0] is None and asked[0] == [drafter.block_size] * 2  # no past step: every draft
    assert any(b < drafter.block_size for b in bounds[1:]), bounds  # the bound did cut
    for bound, sizes in zip(bounds[1:], asked[1:]):
        assert sizes == [min(bound, drafter.block_size)] * 2
    assert policy.greedy_share == 0.0  # the step told the planner its batch's sampling: none greedy
    states[0].sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    speculative_step(target, drafter, states, caches, adapter)
    assert policy.greedy_share == 0.5


def test_the_gate_scales_the_survivals_to_the_step_s_requests() -> None:
    # 16 ms of drafting: one request's best is 3.426 tokens in 10 + 2 * 5 + 16 = 36 ms -> .0952 > 1 / 12: draft.
    # At 4 requests the survivals count 4 times: the best, 4 * 3.124 tokens in 10 + 2 * 16 + 16 = 58 ms -> .2154,
    # is below a plain step's 4 in 18 ms -> .222: skip. Drafting costs 16 ms at any count here.
    policy = _gate(16.0)
    assert policy.should_draft(1)
    assert not policy.should_draft(4)
    # the scaled pool equals four identical requests' pool at every whole number of requests' worth of drafts
    four = AsyncTopKScheduler(policy.cost, lag=1)
    four.choose(GATE_C.repeat(4, 1), GATE_N.repeat(4))
    assert not four.should_draft(4) and four.should_draft(1)


def test_every_probe_every_th_decision_starts_a_probe_of_the_other_kind_of_step() -> None:
    # measured: plain 100 tokens/s, drafting 91 (a drafting step 1.1 plain steps): plain steps, drafting probes of
    # probe_steps steps every probe_every decisions (int(3 * 1.1^2) = 3 decisions between them)
    policy = _gate(40.0, probe_every=4, probe_steps=2)
    _steps(policy, 1, False, 1, 0.010)
    _steps(policy, 1, True, 1, 0.011, n=2)  # the first catches up: not measured
    decisions = [policy.should_draft(1) for _ in range(12)]
    assert decisions == [False, False, False, True, True, False, False, False, True, True, False, False]
    assert policy.skipped_steps == 8
    drafting = _gate(1.0, probe_every=4, probe_steps=2)  # the model says: draft; a plain probe is one step
    assert [drafting.should_draft(1) for _ in range(8)] == [True, True, True, False, True, True, True, False]
    policy.reset()
    assert policy.should_draft(1)  # the history is gone: draft until survivals are seen again
    with pytest.raises(ValueError, match="probe_every"):
        AsyncTopKScheduler(policy.cost, probe_every=0)
    with pytest.raises(ValueError, match="probe_steps"):
        AsyncTopKScheduler(policy.cost, probe_every=4, probe_steps=4)


def test_drafting_probes_come_rarer_where_a_drafting_step_costs_more() -> None:
    # the model: a plain step 12 ms, a drafting step 40 ms more (r = 52 / 12): int(3 * r^2) = 56 plain decisions
    # before the first drafting probe, against 3 where drafting costs about a plain step (above)
    policy = _gate(40.0, probe_every=4, probe_steps=2)
    decisions = [policy.should_draft(1) for _ in range(60)]
    assert decisions.index(True) == 56 and decisions[57] and not any(decisions[58:])
    # measured times take over from the model: drafting steps 2x a plain step -> int(3 * 4) = 12
    _steps(policy, 1, False, 1, 0.010, n=2)
    _steps(policy, 1, True, 1, 0.020, n=3)
    decisions = [policy.should_draft(1) for _ in range(20)]
    assert [i for i, d in enumerate(decisions) if d] == [10, 11]  # 12 - 2 decisions already counted since the probe


def _steps(policy: AsyncTopKScheduler, requests: int, drafted: bool, tokens: int, seconds: float, n: int = 1) -> None:
    for _ in range(n):
        policy.observe_step(requests, drafted, tokens, seconds)


def test_measured_rates_of_both_kinds_of_step_overrule_the_model() -> None:
    policy = _gate(40.0, probe_every=1000)  # the model says: plain steps
    _steps(policy, 1, True, 3, 0.05, n=4)  # drafting at 60 tokens/s (the first, catching up, is not measured) ...
    assert not policy.should_draft(1)  # ... but one kind alone does not decide
    _steps(policy, 1, False, 1, 0.025)  # plain at 40 tokens/s: drafting is faster here after all
    assert policy.should_draft(1)
    _steps(policy, 1, False, 1, 0.01, n=15)  # plain steps get faster: 16 steps in 0.175 s, 91 tokens/s
    assert not policy.should_draft(1)
    # rates are kept per request count: 2 requests have none yet, so the model answers there
    _steps(policy, 2, True, 4, 0.05, n=4)  # after a plain step: the first one catches up
    assert not policy.should_draft(2)
    _steps(policy, 2, False, 2, 0.1)  # 80 against 20 tokens/s
    assert policy.should_draft(2) and not policy.should_draft(1)
    _steps(policy, 2, False, 2, 0.0)  # an untimed step is ignored
    assert policy.should_draft(2)


def test_a_gain_measured_at_a_near_request_count_moves_there_as_the_model_s_gain_moves() -> None:
    # the model says plain at every count (gain .692 at 1 request, .685 at 2 and 3); measured at 1 request, drafting
    # makes 100 tokens/s against plain's 80: a gain of 1.25
    policy = _gate(40.0, probe_every=1000)
    _steps(policy, 1, False, 1, 0.0125)
    _steps(policy, 1, True, 4, 0.04, n=4)  # the first catches up: not measured
    assert policy._expected_gain(2) == pytest.approx(1.25 * policy._model_gain(2) / policy._model_gain(1))
    assert policy.should_draft(2)  # 1.237: 2 requests take 1 request's measured gain, moved as the model's moves
    assert not policy.should_draft(3)  # 1 request is more than a factor of 2 away: the model answers
    # measured at 2 requests too: the nearest count answers for 3 (ties go to the larger), and its own
    # measurement for 2
    _steps(policy, 2, False, 2, 0.0125)  # plain at 160 tokens/s
    _steps(policy, 2, True, 2, 0.0125)  # after a plain step: catching up, not measured
    _steps(policy, 2, True, 2, 0.025, n=3)  # drafting at 80 tokens/s: a gain of .5
    assert not policy.should_draft(2) and not policy.should_draft(3) and policy.should_draft(1)
    assert policy._nearest_measured(3) == 2 and policy._nearest_measured(5) is None


def test_at_a_new_request_count_a_plain_step_is_measured_before_the_model_decides() -> None:
    policy = _gate(1.0, probe_every=1000)  # the model says: draft, at any count
    assert policy.should_draft(1)  # nothing measured anywhere yet: the model decides
    _steps(policy, 1, True, 4, 0.04, n=4)  # drafting measured at 1 request (the first step catches up)
    assert not policy.should_draft(1)  # the gate measures steps now: a plain step first where none was measured
    _steps(policy, 1, False, 1, 0.0125)
    assert policy.should_draft(1)  # both measured: 100 against 80 tokens/s
    assert not policy.should_draft(5)  # 5 requests: nothing measured within a factor of 2, so a plain step first
    _steps(policy, 5, False, 5, 0.02)
    assert policy.should_draft(5)  # plain measured there: the model answers until drafting is measured too
    assert policy.should_draft(2)  # 1 request's measurements answer for 2


def test_a_drafting_step_after_a_plain_one_is_not_measured() -> None:
    policy = _gate(40.0, probe_every=1000)
    _steps(policy, 1, False, 1, 0.0125)  # plain: 80 tokens/s
    _steps(policy, 1, True, 2, 0.5)  # catching up on the plain steps' context: slow, and left out
    assert policy.measured(1) == (None, (1, 1.0, 0.0125))
    _steps(policy, 1, True, 4, 0.04, n=3)  # steady drafting: 100 tokens/s
    assert policy.should_draft(1)


def test_one_unlucky_drafting_step_does_not_decide() -> None:
    # the model says draft; plain measured at 80 tokens/s. A drafting step commits 1 to 1 + K tokens: the gate waits
    # for probe_steps - 1 measured drafting steps (what a probe measures) before their rate overrules the model
    policy = _gate(1.0, probe_every=1000)
    assert policy.min_drafting_steps == 3
    _steps(policy, 1, False, 1, 0.0125)
    _steps(policy, 1, True, 1, 0.04, n=3)  # catching up, then two 1-token steps: 25 tokens/s
    assert policy.measured(1)[0][0] == 2 and policy.should_draft(1)  # two steps are luck: the model still answers
    _steps(policy, 1, True, 1, 0.04)  # the third: now the window decides
    assert not policy.should_draft(1)
    assert AsyncTopKScheduler(policy.cost, probe_every=8, probe_steps=1).min_drafting_steps == 1


def test_measured_rates_are_tokens_over_seconds_of_a_window_not_a_mean_of_step_rates() -> None:
    policy = _gate(40.0, probe_every=1000)
    _steps(policy, 1, False, 1, 0.0125, n=8)  # plain: 80 tokens/s
    _steps(policy, 1, True, 4, 0.04)  # catching up: not measured
    # drafting steps alternate 1 and 7 tokens in 0.04 s: 4 tokens per 0.04 s, 100 tokens/s
    for _ in range(8):
        _steps(policy, 1, True, 1, 0.04)
        _steps(policy, 1, True, 7, 0.04)
    assert policy.should_draft(1)
    # one unlucky drafting step (1 token in a slow 0.06 s) moves the window by 1/16, not a per-step rate's 1/4:
    # (4 - 3/16) tokens over (0.04 + 0.02/16) s = 92 tokens/s, still above plain's 80 (a mean of per-step rates
    # moved 1/4 of the way to 17 tokens/s would read 79)
    _steps(policy, 1, True, 1, 0.06)
    assert policy.should_draft(1)
    _steps(policy, 1, True, 1, 0.04, n=16)  # a whole window of 1-token steps (25 tokens/s): plain wins
    assert not policy.should_draft(1)


def test_a_probe_measures_the_rarely_run_kind_anew() -> None:
    policy = _gate(40.0, probe_every=8, probe_steps=3)
    _steps(policy, 1, False, 1, 0.010, n=4)  # plain: 100 tokens/s
    _steps(policy, 1, True, 1, 0.011, n=17)  # drafting: 91 tokens/s over a 16-step window (the first caught up)
    _steps(policy, 1, False, 1, 0.010)
    # a drafting step costs 1.1 plain ones: int(7 * 1.21) = 8 plain decisions, then the probe
    decisions = [policy.should_draft(1) for _ in range(8)]
    assert decisions == [False] * 8
    assert policy.should_draft(1)  # the probe: 3 drafting steps; the requests' content changed, acceptance rose
    _steps(policy, 1, True, 6, 0.011)  # catching up: not measured
    assert policy.should_draft(1)
    _steps(policy, 1, True, 6, 0.011)  # 545 tokens/s: the probe's first measured step replaces the stale window
    assert policy.should_draft(1)  # the probe's last step
    _steps(policy, 1, True, 6, 0.011)
    assert policy.should_draft(1)  # no probe left: the fresh measurement says draft
    assert policy.measured(1)[0][0] == 2  # the window holds the probe's two measured steps only


def test_a_batch_mostly_new_to_drafting_is_probed_sooner() -> None:
    # plain 100 tokens/s against drafting's 91 (a drafting step 1.1 plain ones): 8 plain decisions before a drafting
    # probe; while most of the batch has never drafted, its acceptance is unknown: 8 // 4 = 2
    def measured_gate(drafting_s: float) -> AsyncTopKScheduler:
        policy = _gate(40.0, probe_every=8, probe_steps=3)
        _steps(policy, 1, False, 1, 0.010, n=4)
        _steps(policy, 1, True, 1, drafting_s, n=17)
        _steps(policy, 1, False, 1, 0.010)
        return policy

    policy = measured_gate(0.011)
    assert [policy.should_draft(1, 0) for _ in range(9)] == [False] * 8 + [True]
    policy = measured_gate(0.011)
    assert [policy.should_draft(1, 1) for _ in range(3)] == [False, False, True]
    # two requests, one new: not most of the batch
    policy = measured_gate(0.011)
    _steps(policy, 2, False, 2, 0.010, n=2)
    _steps(policy, 2, True, 2, 0.011, n=4)
    assert [policy.should_draft(2, 1) for _ in range(3)] == [False] * 3
    # where a drafting step costs 2 plain ones (more than NEW_BATCH_MAX_RATIO), probes keep their spacing: 7 * 4
    policy = measured_gate(0.020)
    assert [policy.should_draft(1, 1) for _ in range(29)] == [False] * 28 + [True]


def test_drafting_goes_on_measuring_while_its_window_cannot_tell_the_kinds_apart() -> None:
    # plain: 100 tokens/s, steady. Drafting steps alternate 1 and 7 tokens, so 3 of them say little about the rate
    def gate_after_drafting(seconds: float, n: int) -> AsyncTopKScheduler:
        policy = _gate(40.0, probe_every=1000)  # the model says: plain steps
        _steps(policy, 1, False, 1, 0.010, n=4)
        _steps(policy, 1, True, 4, seconds)  # catching up: not measured
        for i in range(n):
            _steps(policy, 1, True, 1 if i % 2 == 0 else 7, seconds)
        return policy

    # 3 steps of 1, 7, 1 tokens in 0.045 s each: 67 tokens/s measured, with a relative standard error of about
    # 0.67: within noise of plain's rate, so drafting goes on measuring
    policy = gate_after_drafting(0.045, 3)
    assert policy._expected_gain(1) == pytest.approx(2 / 3) and policy._gain_within_noise(1)
    assert policy.should_draft(1)
    # a full window (16 steps, 89 tokens/s, standard error 0.19) is still within noise, but its rate decides now
    policy = gate_after_drafting(0.045, AsyncTopKScheduler.RATE_WINDOW)
    assert policy._gain_within_noise(1) and not policy.should_draft(1)
    # far below plain (at 0.2 s a step, 15 tokens/s) three steps settle it
    policy = gate_after_drafting(0.200, 3)
    assert not policy._gain_within_noise(1) and not policy.should_draft(1)
    # steps that all commit the same tokens in the same time have no spread: the rate decides at once
    policy = _gate(40.0, probe_every=1000)
    _steps(policy, 1, False, 1, 0.010, n=4)
    _steps(policy, 1, True, 4, 0.041, n=4)
    assert not policy._gain_within_noise(1) and not policy.should_draft(1)


def test_drafting_probes_keep_the_plain_spacing_while_the_gain_is_within_noise() -> None:
    # a drafting step costs 2.5 plain ones: int(7 * 6.25) = 43 decisions before a drafting probe where the window
    # settled plain, 7 (as before a plain probe) where it cannot tell, since then a probe costs about what it may gain
    def measured_gate(tokens: list[int]) -> AsyncTopKScheduler:
        policy = _gate(40.0, probe_every=8, probe_steps=3)
        _steps(policy, 1, False, 1, 0.010, n=4)  # plain: 100 tokens/s
        for t in [2] + tokens * (AsyncTopKScheduler.RATE_WINDOW // len(tokens)):  # the first catches up
            _steps(policy, 1, True, t, 0.025)
        _steps(policy, 1, False, 1, 0.010)
        return policy

    settled = measured_gate([2])  # 80 tokens/s, every step alike
    assert [settled.should_draft(1) for _ in range(44)] == [False] * 43 + [True]
    noisy = measured_gate([1, 1, 1, 5])  # 80 tokens/s, from steps of 1 and 5 tokens
    assert noisy._gain_within_noise(1)
    assert [noisy.should_draft(1) for _ in range(8)] == [False] * 7 + [True]


@pytest.mark.parametrize("requests", [1, 2, 16])
def test_the_gate_reaches_the_faster_kind_s_rate_on_noisy_steps(requests: int) -> None:
    # Drafting at 1.12x plain, one request: with a verdict from each window's point estimate alone, the gate ran
    # plain in about two thirds of the steps (0.92 of drafting's rate); where drafting loses, the measuring costs little
    from dspark.simulate.gate_noise import gate_efficiency, synthetic_gate

    for gain in (0.7, 0.9, 1.12, 1.25):
        mean = sum(gate_efficiency(synthetic_gate, gain, requests, seed) for seed in range(24)) / 24
        assert mean >= 0.95, (gain, mean)


@pytest.mark.parametrize("requests", [2, 8])
def test_the_gate_keeps_up_when_the_request_count_moves(requests: int) -> None:
    # clients coming and going move the count by one in 15 % of the steps (8 requests: between 6 and 8); the gate
    # keeps its rates per count, so it measures each count anew, and still reaches the faster kind's rate
    from dspark.simulate.gate_noise import churn_range, gate_efficiency, synthetic_gate

    assert churn_range(1) == (1, 1) and churn_range(2) == (1, 2) and churn_range(8) == (6, 8)
    for gain in (0.7, 0.9, 1.12, 1.25):
        mean = sum(gate_efficiency(synthetic_gate, gain, requests, seed, churn=0.15) for seed in range(24)) / 24
        assert 0.95 <= mean <= 1.01, (gain, mean)


def test_the_gate_noise_efficiency_is_against_the_better_kind_at_each_step_s_count() -> None:
    # a gate that always drafts reaches gain / max(gain, 1) of the best, up to the steps' noise, at any churn
    from dspark.simulate.gate_noise import gate_efficiency, synthetic_gate

    def always() -> AsyncTopKScheduler:
        gate = synthetic_gate()
        gate.should_draft = lambda num_requests, never_drafted=0: True  # type: ignore[method-assign]
        return gate

    for gain, churn in ((0.8, 0.0), (0.8, 0.3), (1.2, 0.3)):
        mean = sum(gate_efficiency(always, gain, 8, seed, churn=churn) for seed in range(8)) / 8
        assert mean == pytest.approx(gain / max(gain, 1.0), rel=0.02), (gain, churn, mean)


def _requests(*own: tuple[int, int]) -> list[RequestState]:
    """Requests with (drafted_steps, drafted_tokens) each."""
    return [RequestState(str(i), 1, [1], SamplingParams(0.0), torch.Generator(), drafted_steps=s, drafted_tokens=t)
            for i, (s, t) in enumerate(own)]


def test_in_a_plain_step_the_requests_whose_own_acceptance_pays_draft() -> None:
    policy = _gate(40.0, probe_every=1000)
    _steps(policy, 4, False, 4, 0.030)  # 4 requests: plain steps measured at 30 ms (133 tokens/s)
    batch = _requests((10, 32), (10, 13), (10, 20), (0, 0))  # own acceptance 3.2, 1.3, 2.0, unknown
    # nothing measured of drafting yet: the model prices one drafting request (verify 10 + 2B ms, drafting 40 ms):
    # from 18 ms to 70 ms for 4 + 6 rows, times 30 / 18 -> 87 ms: no request pays that, nor would one of 2 tokens
    # per step (1 * 30 < 4 * 87), so the one without a record of its own does not draft to get one either
    assert policy.drafting_requests(batch) == [False] * 4
    # all drafting measured at 60 ms for 5 tokens (plain still wins): 30 ms more for 4 requests, 7.5 ms each
    _steps(policy, 4, True, 5, 0.060, n=4)
    assert not policy.should_draft(4) and policy._marginal_seconds(4, 0.030) == pytest.approx(0.0075)
    # 3.2 pays from 1 + 4 * 7.5 / 30 = 2; then 6.2 tokens in 37.5 ms, which 2.0's 1 / 7.5 ms does not beat
    assert policy.drafting_requests(batch) == [True, False, False, False]
    # steps where 1 request drafted took 40 ms: measured, one drafting request adds 10 ms
    for _ in range(3):
        policy.observe_step(4, True, 6, 0.040, num_drafting=1)
    assert policy.measured_marginal() == {4: (3, pytest.approx(0.010))}
    assert policy.drafting_requests(batch) == [True, False, False, False]  # 3.2 pays from 1 + 4 * 10 / 30
    assert policy._marginal_seconds(7, 0.03) == pytest.approx(0.010)  # within a factor of 2: 4's answers for 7
    # a partial step is not a drafting step of all requests: the window of those stays as it was
    assert policy.measured(4)[0][0] == 3
    # a drafting probe drafts every request (r = 60 / 30 = 2: int(2 * 4) = 8 decisions apart) ...
    probing = _gate(40.0, probe_every=3, probe_steps=2)
    _steps(probing, 4, False, 4, 0.030)
    _steps(probing, 4, True, 5, 0.060, n=4)
    for _ in range(3):
        probing.observe_step(4, True, 6, 0.040, num_drafting=1)
    some = [True, False, False, False]
    assert [probing.drafting_requests(batch) for _ in range(11)] == [some] * 8 + [[True] * 4] * 2 + [some]
    # ... where drafting wins, every request drafts, and a plain probe (every 3rd decision) drafts none
    drafting = _gate(1.0, probe_every=3, probe_steps=2)
    _steps(drafting, 4, False, 4, 0.060)
    _steps(drafting, 4, True, 8, 0.060, n=4)
    assert [drafting.drafting_requests(batch) for _ in range(4)] == [[True] * 4] * 2 + [[False] * 4] + [[True] * 4]


def test_a_request_without_a_record_drafts_where_a_typical_drafting_request_pays() -> None:
    # one request: plain 30 ms, drafting 40 ms for 2.5 tokens (62.5 tokens/s against 33: drafting wins) ...
    policy = _gate(40.0, probe_every=1000)
    _steps(policy, 1, False, 1, 0.030)
    _steps(policy, 1, True, 3, 0.040, n=4)
    assert policy.drafting_requests(_requests((0, 0))) == [True]
    # ... then plain wins (drafting 1 token in 40 ms): the requests before had a low acceptance. A new request
    # drafts until it has a record (one of 2 tokens per step would pay: 1 * 30 ms > 1 * 10 ms), then by its own
    _steps(policy, 1, True, 1, 0.040, n=48)
    assert not policy.should_draft(1)
    assert policy.drafting_requests(_requests((0, 0))) == [True]
    assert policy.drafting_requests(_requests((2, 7))) == [True]  # 3.5 per step: its drafting pays
    assert policy.drafting_requests(_requests((2, 2.4))) == [False]  # 1.2: it does not
    # at 4 requests one more drafting request costs 10 ms of a 30 ms step: a 2-token request would not pay there
    policy = _gate(40.0, probe_every=1000)
    _steps(policy, 4, False, 4, 0.030)
    _steps(policy, 4, True, 5, 0.070, n=4)
    assert policy.drafting_requests(_requests((0, 0), (0, 0), (0, 0), (0, 0))) == [False] * 4


def test_a_block_of_some_requests_spreads_to_the_batch() -> None:
    from dspark.drafters.base import DraftBlock

    block = DraftBlock(torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 1]), torch.rand(2, 2, 4),
                       torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 3, 5, 9]))
    wide = block.spread([3, 1], 4)
    assert wide.tokens.tolist() == [[0, 0], [7, 8], [0, 0], [5, 6]]
    assert wide.num_tokens.tolist() == [0, 1, 0, 2]
    assert torch.equal(wide.draft_probs[3], block.draft_probs[0]) and not wide.draft_probs[0].any()
    assert wide.confidence_logits.tolist() == [[0, 0], [3, 4], [0, 0], [1, 2]] and wide.vocab is block.vocab
