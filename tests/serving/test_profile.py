"""SPS profiling and the whole-step cost model of a real (tiny) target: `dspark profile`, serving's start-up profile."""

from __future__ import annotations

import gc
import json

import pytest

from dspark.cli import main
from dspark.scheduler.profile import batch_token_grid, load_or_profile, profile_target
from dspark.scheduler.sps import SPSTable
from dspark.serving.engine import Engine
from dspark.scheduler.adapter import make_policy
from dspark.sampling.processing import SamplingParams
from tests.tiny import save_hf_folder, tiny_config, tiny_target


def test_grid_times_one_request_densely_then_sglang_points():
    # every count of one request (anchor + 0..gamma drafts), then R x (gamma + 1) at R = 2, 3, 4, 6, 8, 12, ...
    assert batch_token_grid(7, 3) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24]
    assert batch_token_grid(1, 40) == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80]  # and max_requests
    assert batch_token_grid(7, 1) == list(range(1, 9))
    assert batch_token_grid(3, 2, dense=True) == list(range(1, 9))
    with pytest.raises(ValueError):
        batch_token_grid(7, 0)


def test_profile_target_builds_a_table_and_keeps_contexts():
    target = tiny_target()
    calls = _spy_verify_passes(target)
    table = profile_target(target, block_size=3, max_requests=3, context_len=16, repeats=2, warmup=1)
    # timed at 1, 2, 3, 4, 8, 12 batch tokens; the table holds every count (linear between: SPSTable.filled)
    assert table.sample_batch_tokens == tuple(range(1, 13)) and table.max_batch_tokens == 12
    assert all(s > 0 for s in table.sample_steps_per_sec)
    # 6 grid points x (1 warm-up + 2 timed) verify passes of ceil(B / (gamma + 1)) requests (the last one shorter),
    # always against caches holding exactly the context (rolled back after every pass)
    assert [sum(lens) for lens, _ in calls] == [b for b in (1, 2, 3, 4, 8, 12) for _ in range(3)]
    assert all(lens[:-1] == [4] * (len(lens) - 1) and starts == [16] * len(lens) for lens, starts in calls)
    dense = profile_target(target, block_size=3, max_requests=2, context_len=8, repeats=1, warmup=0, dense=True)
    assert dense.sample_batch_tokens == tuple(range(1, 9))
    with pytest.raises(ValueError, match="context"):
        profile_target(target, block_size=3, max_requests=1, context_len=510)


def test_prefill_profile_times_one_request_chunk_with_last_token_logits():
    target = tiny_target()
    calls = []
    forward = target.forward

    def spy(ids, seq_lens, caches, *args, **kwargs):
        calls.append((list(seq_lens), [c.length for c in caches], kwargs.get("logits_for")))
        return forward(ids, seq_lens, caches, *args, **kwargs)

    target.forward = spy
    table = profile_target(target, block_size=7, max_requests=3, context_len=0, repeats=2, warmup=1, prefill=True)
    assert table.sample_batch_tokens == tuple(range(1, 25))
    # one request per pass, B tokens into a cache rolled back to the context (empty here), last-token logits
    assert [c[0] for c in calls] == [[b] for b in (1, 2, 3, 4, 5, 6, 7, 8, 16, 24) for _ in range(3)]
    assert all(starts == [0] and logits == "last" for _, starts, logits in calls)
    calls.clear()
    profile_target(target, block_size=7, max_requests=1, context_len=16, repeats=1, warmup=0, prefill=True)
    assert calls[0][2] == "none" and calls[1] == ([1], [16], "last")  # the context, then a chunk after it
    with pytest.raises(ValueError, match="context"):
        profile_target(target, block_size=7, max_requests=1, context_len=0, repeats=1)  # verify needs context


def test_profile_cli_writes_sglang_json_and_engine_uses_it(tmp_path):
    folder = save_hf_folder(tmp_path / "tiny", tiny_config())
    out = tmp_path / "sps.json"
    rc = main(["profile", "--target", str(folder), "--block-size", "3", "--max-requests", "2",
               "--context-len", "8", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    assert data["sample_batch_tokens"] == list(range(1, 9))
    table = load_or_profile(out, tiny_target(), 3, 2)
    assert table == SPSTable.load(out)

    target = tiny_target()
    quick = load_or_profile(None, target, 3, 2, context_len=8, repeats=1, log=lambda *_: None)
    assert quick.sample_batch_tokens == tuple(range(1, 9))
    with Engine(target, None, make_policy("alg1", quick)) as engine:
        assert engine.generate([3, 4, 5], SamplingParams(0.0, max_new_tokens=4), timeout=30)


# ------------------------------------------------------------ whole-step cost model
def _spy_verify_passes(target):
    """Record (seq_lens, cache lengths) of every verify pass (logits for all positions)."""
    calls = []
    forward = target.forward

    def spy(ids, seq_lens, caches, *args, **kwargs):
        if kwargs.get("logits_for") == "all":
            calls.append((list(seq_lens), [c.length for c in caches]))
        return forward(ids, seq_lens, caches, *args, **kwargs)

    target.forward = spy
    return calls


@pytest.mark.parametrize("kind", ["prompt-lookup", "dspark"])
def test_step_cost_profile_times_real_steps_that_verify_every_draft(kind):
    from dspark.drafters.dspark.drafter import DSparkDrafter
    from dspark.drafters.prompt_lookup import PromptLookupDrafter
    from dspark.generation.step_profile import profile_step_cost
    from tests.drafters.tiny_drafters import tiny_dspark

    target = tiny_target()
    drafter = PromptLookupDrafter(target.vocab_size, 3) if kind == "prompt-lookup" else DSparkDrafter(tiny_dspark(target))
    calls = _spy_verify_passes(target)
    model = profile_step_cost(target, drafter, 3, max_requests=3, context_len=20, repeats=2, warmup=1)
    assert model.verify.grid == tuple(range(1, 13)) and model.max_batch_tokens == 12
    assert model.draft.grid == model.host.grid == model.host_greedy.grid == (1, 2, 3)
    assert all(t >= 0 for t in model.draft.ms + model.host.ms + model.host_greedy.ms) and not model.draft.is_zero
    assert model.profile == {"threads": model.profile["threads"], "dtype": "float32", "device": "cpu",
                             "block_size": 3, "context_len": 20, "repeats": 2, "target": "tiny",
                             "source": "dspark profile"}
    steps = calls[-18:]  # the engine steps: R = 1, 2, 3, sampled then greedy, each 1 warm-up + 2 timed
    assert [len(lens) for lens, _ in steps] == [1] * 6 + [2] * 6 + [3] * 6
    # every step drafts and verifies gamma tokens per request, from the same rolled-back context
    assert all(lens == [4] * len(lens) and starts == [20] * len(starts) for lens, starts in steps)


def test_step_cost_profile_without_drafter_is_plain_decoding():
    from dspark.generation.step_profile import profile_step_cost

    target = tiny_target()
    calls = _spy_verify_passes(target)
    model = profile_step_cost(target, None, 3, max_requests=2, context_len=8, repeats=1, warmup=0)
    assert [lens for lens, _ in calls[-4:]] == [[1], [1], [1, 1], [1, 1]]  # nothing drafted: the anchors alone
    assert model.verify.grid == tuple(range(1, 9))


def test_profile_cli_writes_the_step_cost_model_and_serving_plans_on_it(tmp_path, capsys):
    from dspark.generation.step_profile import load_or_profile_cost
    from dspark.scheduler.step_cost import StepCostModel

    folder = save_hf_folder(tmp_path / "tiny", tiny_config())
    sps, cost = tmp_path / "sps.json", tmp_path / "step_cost.json"
    rc = main(["profile", "--target", str(folder), "--drafter", "prompt-lookup", "--block-size", "3",
               "--max-requests", "2", "--context-len", "8", "--repeats", "1", "--out", str(sps),
               "--step-cost", str(cost)])
    assert rc == 0
    table, model = SPSTable.load(sps), StepCostModel.load(cost)
    assert model.to_sps_table() == table  # one verify measurement feeds both files
    assert model.profile["drafter"] == "prompt-lookup" and model.profile["block_size"] == 3
    assert model.draft.grid == (1, 2)
    assert main(["profile", "--target", str(folder), "--prefill", "--step-cost", str(cost)]) != 0
    assert "--prefill" in capsys.readouterr().err

    from dspark.drafters.prompt_lookup import PromptLookupDrafter

    target = tiny_target()
    drafter = PromptLookupDrafter(target.vocab_size, 3)
    assert load_or_profile_cost(cost, target, drafter, 2) == model  # --sps-table FILE: either format
    assert load_or_profile_cost(sps, target, drafter, 2) == StepCostModel.from_sps_table(table)
    saved = tmp_path / "at_start.json"
    at_start = load_or_profile_cost(None, target, drafter, 2, profile_to=saved, context_len=8, repeats=1,
                                    log=lambda *_: None)  # --profile-step-cost FILE
    assert StepCostModel.load(saved) == at_start and at_start.draft.grid == (1, 2)
    with Engine(target, drafter, make_policy("alg1", at_start)) as engine:
        assert engine.generate([3, 4, 5, 3, 4, 5], SamplingParams(0.0, max_new_tokens=6), timeout=30)


def test_serve_profiles_the_whole_step_at_start_when_asked(tmp_path, capsys):
    from dspark.cli import build_parser
    from dspark.scheduler.step_cost import StepCostModel
    from dspark.serving.cli import build_engine
    from tests.tiny import save_chat_target

    folder, _ = save_chat_target(tmp_path / "chat")
    saved = tmp_path / "runs" / "step_cost.json"
    saved.parent.mkdir()
    args = build_parser().parse_args(["serve", "--target", str(folder), "--dtype", "float32", "--drafter",
                                      "prompt-lookup", "--block-size", "3", "--policy", "alg1", "--max-batch", "2",
                                      "--no-malloc-tuning", "--profile-step-cost", str(saved)])
    try:
        engine = build_engine(args)
    finally:
        gc.unfreeze()  # build_engine freezes the start-up heap (serving.memory); not this test process's
    model = StepCostModel.load(saved)
    assert engine.policy.policy.cost == model and not model.verify_only
    assert model.draft.grid == (1, 2) and model.profile["drafter"] == "prompt-lookup"
    assert "plan on the whole step" in capsys.readouterr().err
    # --sps-table reads the saved model back; an SPS table still loads, as a verify-only model
    args.profile_step_cost, args.sps_table = None, str(saved)
    try:
        assert build_engine(args).policy.policy.cost == model
    finally:
        gc.unfreeze()
