"""The KV cache's size stated from the model config, and 64 concurrent requests with ~2k-token contexts:
admitted, queued or refused with a clear error, never a crash (docs/serving/step-cost.md §Memory)."""

from __future__ import annotations

import pytest

from dspark.errors import PromptError
from dspark.modeling.spec import spec_from_config
from dspark.sampling.processing import SamplingParams
from dspark.serving.cli import kv_cache_line
from dspark.serving.engine import Engine, EngineConfig, QueueFullError, kv_cache_bound
from dspark.serving.engine_process import TargetInfo
from tests.tiny import tiny_target

SMOLLM2_135M = {  # SmolLM2-135M-Instruct's config.json, the fields the cache depends on
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "max_position_embeddings": 8192,
}


def test_kv_bytes_per_token_from_the_config():
    import torch

    spec = spec_from_config(SMOLLM2_135M)
    assert spec.kv_bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2 == 23_040  # docs/architecture.md
    assert spec.kv_bytes_per_token(torch.float32) == 46_080
    target = tiny_target()  # 4 layers, 2 KV heads, head dim 8, float32
    assert target.kv_bytes_per_token == 2 * 4 * 2 * 8 * 4 == target.new_cache(8).pool.bytes_per_token
    assert TargetInfo.of(target).kv_bytes_per_token == target.kv_bytes_per_token  # what the HTTP process logs
    line = kv_cache_line(23_040, 8, 8192)
    assert "23,040 bytes per token" in line and "1.41 GiB" in line  # 8 slots x 8,192 positions x 23,040 B
    assert "180.0 MiB held from the start" in kv_cache_line(23_040, 8, 8192, 1000)  # 8 x 1,024 positions
    line = kv_cache_line(23_040, 8, 8192, 1000, prefix_cache=8)  # 16 slots: twice the bytes, bound included
    assert "360.0 MiB held from the start" in line and "2.81 GiB" in line


def test_serve_defaults_keep_prompts_and_hold_the_cache_from_the_start_within_a_budget():
    import argparse

    from dspark.serving.cli import AUTO_KV_RESERVE, KV_RESERVE_BUDGET, default_kv_reserve, kv_settings

    small = argparse.Namespace(max_batch=8, prefix_cache=None, kv_reserve=None)
    target = argparse.Namespace(kv_bytes_per_token=23_040, max_context=8192)  # SmolLM2-135M in bf16
    assert kv_settings(small, target) == {"kv_reserve": AUTO_KV_RESERVE, "prefix_cache": 8}  # 16 slots x 2,048
    assert default_kv_reserve(23_040, 16, 1000) == 1000  # never past the model's context
    big = default_kv_reserve(147_456, 64, 40_960)  # an 8B model's bf16 KV, 32 + 32 slots: the budget binds
    assert big % 64 == 0 and big < AUTO_KV_RESERVE and 64 * big * 147_456 <= KV_RESERVE_BUDGET
    assert default_kv_reserve(10**9, 64, 8192) == 64  # one key block at least
    given = argparse.Namespace(max_batch=8, prefix_cache=0, kv_reserve=0)  # both off, as given
    assert kv_settings(given, target) == {"kv_reserve": 0, "prefix_cache": 0}


def test_the_engine_sizes_the_pool_for_its_batch_at_start_and_keeps_it():
    target = tiny_target()
    engine = Engine(target, None, None, EngineConfig(max_batch=6, kv_reserve=100, prefix_cache=2))
    with engine:
        pool = target.model.kv_pool
        assert (pool.num_slots, pool.capacity) == (8, 128)  # 6 + 2 kept prompts; whole key blocks of 64
        keys = pool.keys
        handles = [engine.submit(_prompt(40, i), SamplingParams(0.0, max_new_tokens=8)) for i in range(6)]
        assert all(h.result(timeout=60)[0] for h in handles)
        assert target.model.kv_pool.keys is keys  # six requests of 48 positions: never grown
    unreserved = tiny_target()
    with Engine(unreserved, None, None, EngineConfig(max_batch=6, kv_reserve=0)):
        assert unreserved.model.kv_pool is None


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7 + i * 13) % 90 for i in range(n)]


def test_64_concurrent_2k_context_requests_are_admitted_or_queued():
    target = tiny_target(max_position_embeddings=2112)
    engine = Engine(target, None, None, EngineConfig(max_batch=8, max_queue=56, prefill_chunk=512))
    with engine:
        engine.pause()  # all 64 arrive before any is admitted: the worst case for the queue
        handles = [engine.submit(_prompt(2048, i), SamplingParams(0.0, max_new_tokens=4)) for i in range(64)]
        engine.resume()
        results = [h.result(timeout=600) for h in handles]
        with pytest.raises(PromptError, match="context"):  # can never fit: the server's 400
            engine.submit(_prompt(2100, 0), SamplingParams(0.0, max_new_tokens=64))
        stats = engine.stats()
    assert len(results) == 64 and all(reason in ("length", "stop") and tokens for tokens, reason in results)
    assert stats.requests.get("error", 0) == 0
    # 8 decoding, the rest waiting; the pool stayed within the bound the start-up line states
    pool = target.model.kv_pool
    kept = engine.config.prefix_cache
    assert pool.num_slots <= 8 + kept and pool.num_slots * pool.capacity * pool.bytes_per_token <= kv_cache_bound(
        target.kv_bytes_per_token, 8, target.max_context, kept)


def test_beyond_the_queue_requests_are_refused_with_a_clear_error():
    engine = Engine(tiny_target(), None, None, EngineConfig(max_batch=8, max_queue=40))
    with engine:
        engine.pause()
        handles, refused = [], []
        for i in range(64):
            try:
                handles.append(engine.submit(_prompt(32, i), SamplingParams(0.0, max_new_tokens=2)))
            except QueueFullError as err:  # the server's 429
                refused.append(str(err))
        engine.resume()
        results = [h.result(timeout=120) for h in handles]
    assert len(refused) == 16 and all("retry later" in e for e in refused)
    assert all(reason in ("length", "stop") for _, reason in results) and len(results) == 48
