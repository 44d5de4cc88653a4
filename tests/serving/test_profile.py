"""SPS profiling of a real (tiny) target and `dspark profile`."""

from __future__ import annotations

import json

import pytest

from dspark.cli import main
from dspark.scheduler.profile import batch_token_grid, load_or_profile, profile_target
from dspark.scheduler.sps import SPSTable
from dspark.serving.engine import Engine
from dspark.scheduler.adapter import make_policy
from dspark.sampling.processing import SamplingParams
from tests.tiny import save_hf_folder, tiny_config, tiny_target


def test_grid_is_sglang_style_or_dense():
    assert batch_token_grid(7, 3) == [8, 16, 24]
    assert batch_token_grid(3, 2, dense=True) == list(range(1, 9))
    with pytest.raises(ValueError):
        batch_token_grid(7, 0)


def test_profile_target_builds_a_table_and_keeps_contexts():
    target = tiny_target()
    calls = []
    forward = target.forward

    def spy(ids, seq_lens, caches, *args, **kwargs):
        if kwargs.get("logits_for") == "all":
            calls.append((list(seq_lens), [c.length for c in caches]))
        return forward(ids, seq_lens, caches, *args, **kwargs)

    target.forward = spy
    table = profile_target(target, block_size=3, max_requests=3, context_len=16, repeats=2, warmup=1)
    assert table.sample_batch_tokens == (4, 8, 12) and table.max_batch_tokens == 12
    assert all(s > 0 for s in table.sample_steps_per_sec)
    # 3 grid points x (1 warm-up + 2 timed) verify passes, R requests x (gamma + 1) tokens each,
    # always against caches holding exactly the context (rolled back after every pass)
    assert len(calls) == 9
    assert all(lens == [4] * len(lens) and starts == [16] * len(lens) for lens, starts in calls)
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
    assert table.sample_batch_tokens == (8, 16, 24)
    # one request per pass, B tokens into a cache rolled back to the context (empty here), last-token logits
    assert [c[0] for c in calls] == [[8]] * 3 + [[16]] * 3 + [[24]] * 3
    assert all(starts == [0] and logits == "last" for _, starts, logits in calls)
    calls.clear()
    profile_target(target, block_size=7, max_requests=1, context_len=16, repeats=1, warmup=0, prefill=True)
    assert calls[0][2] == "none" and calls[1] == ([8], [16], "last")  # the context, then a chunk after it
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
    assert data["sample_batch_tokens"] == [4, 8]
    table = load_or_profile(out, tiny_target(), 3, 2)
    assert table == SPSTable.load(out)

    target = tiny_target()
    quick = load_or_profile(None, target, 3, 2, context_len=8, repeats=1, log=lambda *_: None)
    assert quick.sample_batch_tokens == (4, 8)
    with Engine(target, None, make_policy("alg1", quick)) as engine:
        assert engine.generate([3, 4, 5], SamplingParams(0.0, max_new_tokens=4), timeout=30)
