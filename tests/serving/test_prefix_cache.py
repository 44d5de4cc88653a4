"""The prefix cache: kept prompts restored bitwise, LRU and alignment rules, and the engine skipping the prefill of
a prompt it has seen, with the same text as without the cache (plain and with a DSpark drafter that reads features)."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import Engine, EngineConfig
from dspark.serving.prefix_cache import PrefixCache, common_prefix
from tests.drafters.tiny_drafters import tiny_dspark
from tests.tiny import tiny_target


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 11 + i * 7) % 90 for i in range(n)]


def _filled(target, prompt: list[int]):
    cache = target.new_cache(len(prompt) + 8)
    target.forward(torch.tensor(prompt), [len(prompt)], [cache], logits_for="none", prompt_from=0)
    return cache


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 9], [1, 2, 3, 4]) == 3
    assert common_prefix([5], [1]) == 0
    assert common_prefix([], [1]) == 0
    long = list(range(1000))
    assert common_prefix(long, long[:637] + [-1] + long[638:]) == 637


def test_restore_copies_the_kept_positions_bitwise_and_always_leaves_a_token_to_feed():
    target = tiny_target(seed=0)
    prompt = _prompt(40, 0)
    kept = _filled(target, prompt)
    want_keys = kept.keys[:, :, :40].clone()
    cache = PrefixCache(4, min_tokens=8)
    assert cache.keep(prompt, kept, None)
    other = target.new_cache(64)
    hit = cache.restore(prompt[:30] + _prompt(10, 5), other, want_features=False)
    assert hit.length == 30 and other.length == 30
    assert torch.equal(other.keys[:, :, :30], want_keys[:, :, :30])
    again = target.new_cache(64)
    assert cache.restore(prompt, again, want_features=False).length == 39  # the last token is fed for its logits
    assert cache.restore(_prompt(40, 9), target.new_cache(64), want_features=False) is None  # nothing in common
    assert cache.restore(prompt[:5] + _prompt(30, 9), target.new_cache(64), want_features=False) is None  # < 8
    assert cache.restore(prompt, target.new_cache(64), want_features=True) is None  # kept without features


def test_alignment_rounds_the_reused_length_down_to_whole_pieces():
    target = tiny_target(seed=0)
    prompt = _prompt(50, 1)
    cache = PrefixCache(2, align=16)
    cache.keep(prompt, _filled(target, prompt), None)
    assert cache.restore(prompt[:45] + [7, 7, 7], target.new_cache(64), want_features=False).length == 32


def test_least_recently_used_prompts_go_first_and_their_slots_return_to_the_pool():
    target = tiny_target(seed=0)
    cache = PrefixCache(2, min_tokens=4)
    prompts = [_prompt(20, s) for s in range(3)]
    caches = [_filled(target, p) for p in prompts]
    pool = caches[0].pool
    cache.keep(prompts[0], caches[0], None)
    cache.keep(prompts[1], caches[1], None)
    assert cache.restore(prompts[0], target.new_cache(32), want_features=False) is not None  # 0 used last now
    used = pool.slots_in_use
    cache.keep(prompts[2], caches[2], None)  # evicts 1
    assert len(cache) == 2 and pool.slots_in_use == used - 1
    assert cache.restore(prompts[1], target.new_cache(32), want_features=False) is None
    assert cache.restore(prompts[0], target.new_cache(32), want_features=False) is not None
    # a prompt already kept inside a longer kept one is not kept twice; one that extends a kept one replaces it
    assert not cache.keep(prompts[2][:10], _filled(target, prompts[2][:10]), None)
    assert cache.keep(prompts[0] + [5, 6, 7], _filled(target, prompts[0] + [5, 6, 7]), None) and len(cache) == 2
    cache.clear()
    assert len(cache) == 0


def _engine_texts(target, drafter, prompts, config):
    with Engine(target, drafter, None, config) as engine:
        texts = []
        for p in prompts:  # one after the other: each finds the earlier ones kept
            texts.append(engine.submit(p, SamplingParams(0.0, max_new_tokens=12)).result(60)[0])
        return texts, engine.stats()


@pytest.mark.parametrize("with_drafter", [False, True])
def test_the_engine_skips_the_prefill_of_a_repeated_prefix_and_decodes_the_same_text(with_drafter):
    target = tiny_target(seed=0)
    target.eos_token_ids = []
    drafter = DSparkDrafter(tiny_dspark(target).eval()) if with_drafter else None
    shared = _prompt(60, 2)
    prompts = [shared + [5, 6], shared + [7, 8, 9], shared + [5, 6], _prompt(30, 7)]
    expected = [SpeculativeGenerator(target, drafter).generate([p], SamplingParams(0.0, max_new_tokens=12))[0]
                .output_ids for p in prompts]
    texts, stats = _engine_texts(target, drafter, prompts, EngineConfig(max_batch=2, prefix_cache=4))
    assert texts == expected
    # the second and third prompts restore 60 and 61 tokens: only 3 + 1 of their 65 + 62 are prefilled
    assert stats.cached_prompt_tokens == 60 + 61
    assert stats.prompt_tokens == sum(map(len, prompts)) - 121
    _, off = _engine_texts(target, drafter, prompts, EngineConfig(max_batch=2, prefix_cache=0))
    assert off.cached_prompt_tokens == 0 and off.prompt_tokens == sum(map(len, prompts))


def test_batch_invariant_reuse_is_bitwise_a_fresh_prefill():
    """Aligned to the prefill chunk, a restored prefix is exactly what the prompt's own pieces would compute."""
    target = tiny_target(seed=0)
    shared = _prompt(40, 3)
    config = EngineConfig(max_batch=1, prefill_chunk=16, batch_invariant=True, prefix_cache=2)
    with Engine(target, None, None, config) as engine:
        engine.submit(shared + [9], SamplingParams(0.0, max_new_tokens=2)).result(60)
        assert engine.stats().cached_prompt_tokens == 0
        engine.submit(shared + [4, 4], SamplingParams(0.0, max_new_tokens=2)).result(60)
        assert engine.stats().cached_prompt_tokens == 32  # two whole pieces of 16
    fresh = target.new_cache(64)
    for a in range(0, 42, 16):  # the pieces a batch-invariant engine feeds
        piece = (shared + [4, 4])[a : a + 16]
        target.forward(torch.tensor(piece), [len(piece)], [fresh], logits_for="none", prompt_from=0)
    kept = PrefixCache(1, align=16)
    first = target.new_cache(64)
    for a in range(0, 41, 16):
        piece = (shared + [9])[a : a + 16]
        target.forward(torch.tensor(piece), [len(piece)], [first], logits_for="none", prompt_from=0)
    kept.keep(shared + [9], first, None)
    restored = target.new_cache(64)
    assert kept.restore(shared + [4, 4], restored, want_features=False).length == 32
    assert torch.equal(restored.keys[:, :, :32], fresh.keys[:, :, :32])
    assert torch.equal(restored.values[:, :, :32], fresh.values[:, :, :32])
