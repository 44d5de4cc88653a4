"""Batch-invariant decoding: a one-token step computed as a verify block computes its rows.

The mechanism is checked on a tiny model (every matmul of a lone-row forward sees two rows, the KV cache and the
outputs are those of one row); the property on the real target in bfloat16 (bitwise equal rows, and greedy
speculative decoding emitting exactly plain decoding's text) where this CPU multiplies bf16 natively.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dspark.drafters.base import NoDrafter
from dspark.drafters.hybrid import HybridDrafter
from dspark.drafters.options import DraftingOptions
from dspark.drafters.prompt_lookup import PromptLookupDrafter
from dspark.drafters.registry import load_drafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.target.model import cpu_has_bf16_matmul, load_target
from tests.tiny import tiny_target

REFERENCE = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-dspark"


def _rows_seen(model: nn.Module, call) -> tuple[list[int], object]:
    """Rows of every nn.Linear input during ``call()``, and its result."""
    rows: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
             for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        return rows, call()
    finally:
        for h in hooks:
            h.remove()


def test_a_lone_row_runs_through_every_matmul_as_two_and_stays_one_row():
    plain, padded = tiny_target(seed=5), tiny_target(seed=5)
    padded.model.model.batch_invariant = True
    ids = torch.randint(0, plain.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    layers = [0, 1]
    results = {}
    for name, target in (("plain", plain), ("padded", padded)):
        cache = target.new_cache(16)
        target.forward(ids[:8], [8], [cache], logits_for="none")
        rows, out = _rows_seen(target.model, lambda: target.forward(ids[8:], [1], [cache], layers, logits_for="all"))
        results[name] = (rows, out, cache)
    rows, out, cache = results["padded"]
    assert rows and set(rows) == {2}, rows  # q/k/v, o, MLP and the LM head: never a one-row matmul
    assert set(results["plain"][0]) == {1}  # without the flag the same step multiplies single rows
    ref = results["plain"][1]
    assert out.logits.shape == ref.logits.shape == (1, plain.vocab_size)
    assert out.features.shape == ref.features.shape and out.last_hidden.shape == ref.last_hidden.shape
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.features, ref.features, atol=1e-5, rtol=1e-5)
    assert cache.length == results["plain"][2].length == 9  # the twin row never reaches the cache
    torch.testing.assert_close(cache.keys[:, :, :9], results["plain"][2].keys[:, :, :9], atol=1e-5, rtol=1e-5)


def test_blocks_of_several_rows_are_left_alone():
    target = tiny_target(seed=5)
    target.model.model.batch_invariant = True
    cache = target.new_cache(16)
    ids = torch.randint(0, target.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    rows, out = _rows_seen(target.model, lambda: target.forward(ids, [2, 4], None, logits_for="last"))
    assert set(rows) == {6, 2}  # the decoder's 6 tokens, the LM head's 2 last tokens
    assert out.logits.shape == (2, target.vocab_size)
    del cache


def test_float32_is_not_padded_by_load_target():
    target = load_target("smollm2-135m", dtype=torch.float32, tokenizer=False, fuse=True, batch_invariant=True)
    assert target.batch_invariant is None and target.model.model.batch_invariant is False


needs_bf16 = pytest.mark.skipif(not cpu_has_bf16_matmul(), reason="this CPU has no native bfloat16 matmul "
                                "(AVX512-BF16 / AMX): bf16 decoding is neither fast nor made exact here")


def load_invariant_bf16_target():
    """SmolLM2 in bf16 made batch-invariant. Only called where the CPU multiplies bf16 natively (``needs_bf16``),
    which is where invariance is promised: there a target that is not invariant is a failure, never a skip
    (a regression in ``Decoder.batch_invariant`` must not turn the exactness tests below into skips)."""
    target = load_target("smollm2-135m", dtype=torch.bfloat16, fuse=True, batch_invariant=True)
    if not target.batch_invariant:
        pytest.fail(f"this CPU multiplies bf16 natively, yet a one-token step and a verify block still differ by "
                    f"{target.step_block_gap():.3g} in a logit after make_batch_invariant()")
    return target


@pytest.fixture(scope="module")
def smollm2_bf16():
    return load_invariant_bf16_target()


@pytest.mark.slow
@needs_bf16
def test_negative_control_a_target_that_loses_invariance_fails_not_skips(monkeypatch):
    """The mutant: nothing pads lone rows (make_batch_invariant never sets the flag, and the prepacked products run
    on the rows they get: ``packed.MIN_ROWS`` 1). The fixture above must then fail the tests (pytest's Failed), not
    skip them."""
    from dspark.modeling import packed
    from dspark.target import model as target_model

    monkeypatch.setattr(packed, "MIN_ROWS", 1)

    def broken(self):
        self.batch_invariant = self.batch_invariance_holds()  # measured, but nothing was made invariant
        return self.batch_invariant

    monkeypatch.setattr(target_model.TargetModel, "make_batch_invariant", broken)
    try:
        load_invariant_bf16_target()
    except pytest.fail.Exception as failed:
        assert "still differ" in str(failed)
        return
    # the mutant loaded: it is one only where oneDNN multiplies a lone row differently from two (most AVX512-BF16
    # CPUs); some AMX machines give a lone row the bits of two, and there unpadded steps are invariant already
    target = load_target("smollm2-135m", dtype=torch.bfloat16, fuse=True, batch_invariant=False)
    assert target.batch_invariance_holds(rows=8, prompt_len=40)  # it really is invariant unpadded, not skipped
    pytest.skip("this CPU multiplies a lone bf16 row as it does two: without padding steps are invariant already, "
                "so the mutant is no mutant here")


@pytest.mark.slow
@needs_bf16
def test_bf16_one_token_steps_equal_a_verify_block_bitwise_on_smollm2(smollm2_bf16):
    assert smollm2_bf16.batch_invariance_holds(rows=8, prompt_len=40)  # a longer context than load_target's check
    assert smollm2_bf16.batch_invariance_holds(rows=3, prompt_len=100)


@pytest.mark.slow
@needs_bf16
def test_bf16_speculative_greedy_text_equals_plain_on_smollm2(smollm2_bf16):
    """What `make demo` shows: in bf16 every drafter reproduces plain greedy decoding token for token."""
    t = smollm2_bf16
    prompts = [t.encode_chat("Write a Python function that returns the n-th Fibonacci number, then explain it."),
               t.encode_chat("A train travels 60 km in 45 minutes. What is its average speed in km/h? Think step "
                             "by step.")]
    sp = SamplingParams(temperature=0.0, max_new_tokens=64)
    plain = [r.output_ids for r in SpeculativeGenerator(t, NoDrafter(t.vocab_size)).generate(prompts, sp)]
    dspark = load_drafter(str(REFERENCE), t, DraftingOptions(dtype="bfloat16", head_top_m=64))
    for drafter in (PromptLookupDrafter(t.vocab_size, 7), dspark, HybridDrafter(dspark, t.vocab_size)):
        for ids, ref in zip(prompts, plain):  # batch 1, as the demo decodes
            out = SpeculativeGenerator(t, drafter).generate([ids], sp)[0]
            assert out.output_ids == ref, type(drafter).__name__
