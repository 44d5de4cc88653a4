"""The target module: KV rollback, cache growth, default layer ids, logits selection, real SmolLM2.

Shapes: T = tokens, V = vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from dspark.modeling.kv_cache import BLOCK
from dspark.target.model import TargetModel, default_target_layer_ids
from tests.tiny import tiny_target

# a Gemma2-shaped tiny target: sliding window 3 on even layers, soft-capping, sandwich norms
TOL = 1e-4  # float32: different chunkings round differently (matmul blocking), by ~1e-5 at |logit| ~ 10
GEMMA2_OVERRIDES = {"model_type": "gemma2", "sliding_window": 3, "query_pre_attn_scalar": 8,
                    "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}


def _ids(n: int, seed: int, vocab: int = 96) -> torch.Tensor:  # (n,)
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _decode(target: TargetModel, chunks: list[torch.Tensor], cache=None) -> list[torch.Tensor]:
    """Feed ``chunks`` one forward each through one cache; logits (T_i, V) per chunk."""
    cache = cache if cache is not None else target.new_cache()
    return [target.forward(c, [len(c)], [cache]).logits for c in chunks]


@pytest.fixture(params=["llama", "gemma2"])
def target(request) -> TargetModel:
    return tiny_target(seed=3) if request.param == "llama" else tiny_target(seed=3, **GEMMA2_OVERRIDES)


def test_rollback_equals_decoding_without_rejected_tokens(target):
    """Append 4, roll back 3, append different tokens: same logits as a run that never saw the 3."""
    prefix, drafted, fresh = _ids(6, 0), _ids(4, 1), _ids(4, 2)
    cache = target.new_cache()
    _decode(target, [prefix], cache)
    _decode(target, [drafted], cache)  # verify step: 4 tokens, only the first is kept
    cache.truncate(len(prefix) + 1)
    assert cache.length == 7
    # one token first: the stale keys of drafted[2:] at positions 8, 9 are still in storage and must be ignored
    got = _decode(target, [fresh[:1], fresh[1:]], cache)
    want = _decode(target, [prefix, drafted[:1], fresh[:1], fresh[1:]])[2:]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=TOL, rtol=0)
    # and equal to one forward over the surviving sequence, without any cache
    seq = torch.cat([prefix, drafted[:1], fresh])
    full = target.forward(seq, [len(seq)], None).logits
    assert torch.allclose(torch.cat(got), full[7:], atol=TOL, rtol=0)
    assert cache.length == len(seq)


def test_rollback_is_detected_when_missing(target):
    """Negative control: without truncate, the rejected tokens change the logits."""
    prefix, drafted, fresh = _ids(6, 0), _ids(4, 1), _ids(4, 2)
    cache = target.new_cache()
    _decode(target, [prefix, drafted], cache)
    stale = _decode(target, [fresh], cache)[0]
    clean = _decode(target, [prefix, drafted[:1], fresh])[2]
    assert (stale - clean).abs().max() > 1e-2


def test_truncate_rejects_bad_lengths(tiny):
    cache = tiny.new_cache()
    tiny.forward(_ids(5, 0), [5], [cache])
    for bad in (-1, 6):
        with pytest.raises(ValueError, match="cannot roll back"):
            cache.truncate(bad)
    cache.truncate(0)
    assert cache.length == 0


def test_cache_grows_beyond_initial_capacity(target):
    seq = _ids(40, 5)
    cache = target.new_cache(capacity=2)
    chunks = [seq[:5], seq[5:6], seq[6:20], seq[20:21], seq[21:40]]
    got = torch.cat(_decode(target, chunks, cache))
    full = target.forward(seq, [len(seq)], None).logits
    assert cache.length == 40 and cache.capacity >= 40
    assert cache.keys.shape[2] == cache.values.shape[2] == cache.capacity
    assert torch.allclose(got, full, atol=TOL, rtol=0)


def test_cache_stops_at_the_context_length():
    target = tiny_target(max_position_embeddings=16)
    cache = target.new_cache(capacity=4)
    target.forward(_ids(10, 0), [10], [cache])
    target.forward(_ids(6, 1), [6], [cache])
    assert cache.length == 16 and cache.capacity == BLOCK  # growth is capped at the context, rounded up to a block
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        target.forward(_ids(1, 2), [1], [cache])


def test_logits_for_last_and_none_in_a_batch(tiny):
    lens = [3, 7, 1]
    ids = torch.cat([_ids(n, 10 + r) for r, n in enumerate(lens)])
    full = tiny.forward(ids, lens, None)
    last = tiny.forward(ids, lens, None, logits_for="last")
    ends = torch.tensor(lens).cumsum(0) - 1
    assert last.logits.shape == (3, tiny.vocab_size)
    assert torch.allclose(last.logits, full.logits[ends], atol=TOL, rtol=0)
    none = tiny.forward(ids, lens, None, logits_for="none", capture_layers=[1])
    assert none.logits is None and none.features.shape == (sum(lens), tiny.hidden_size)
    assert torch.allclose(none.last_hidden, full.last_hidden, atol=TOL, rtol=0)


@pytest.mark.parametrize(("num_layers", "expected"), [
    (36, [1, 9, 17, 25, 33]),  # Qwen3-4B/8B: DeepSpec's target_layer_ids (docs/interop.md §Training configs)
    (40, [1, 10, 19, 28, 37]),  # Qwen3-14B
    (30, [1, 8, 14, 20, 27]),  # SmolLM2-135M
])
def test_default_target_layer_ids_match_deepspec(num_layers, expected):
    assert default_target_layer_ids(num_layers) == expected


def test_default_target_layer_ids_properties():
    for num_layers in range(4, 81):
        ids = default_target_layer_ids(num_layers)
        assert ids == sorted(set(ids)), num_layers
        assert ids[0] == 1 and ids[-1] == num_layers - 3, num_layers  # layer 1 .. L-3, never the last layer
        if num_layers >= 8:
            assert len(ids) == 5, num_layers
    assert default_target_layer_ids(3) == [0, 1, 2]
    assert default_target_layer_ids(36, count=3) == [1, 17, 33]


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    """Our decoder on the real SmolLM2-135M equals HF's AutoModelForCausalLM on a chat prompt."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(smollm2.encode_chat("What is the capital of France?"))
    smollm2.check_prompt(ids.tolist())
    hf = AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids[None], use_cache=False, output_hidden_states=True)
    want = ref.logits[0]  # (T, V)
    layers = smollm2.default_layer_ids()
    out = smollm2.forward(ids, [len(ids)], None, capture_layers=layers)
    got = out.logits  # (T, V)
    assert got.shape == want.shape == (len(ids), 49152)
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    H = smollm2.hidden_size
    for i, layer in enumerate(layers):  # context features: HF hidden_states[l + 1]
        assert (out.features[:, i * H : (i + 1) * H] - ref.hidden_states[layer + 1][0]).abs().max().item() < 1e-3


@pytest.mark.slow
def test_a_conversion_another_process_finished_first_is_used(smollm2, tmp_path, monkeypatch):
    """Two shards start on a fresh machine: both convert the GGUF preset, the second rename finds the first's
    folder. The second takes it instead of failing, and leaves no temporary folder behind."""
    import tempfile

    import dspark.target.convert as convert
    from dspark.target.presets import PRESETS

    out = tmp_path / "smollm2-135m"
    real_mkdtemp = tempfile.mkdtemp

    def other_process_finishes(*args, **kwargs):  # the other shard's folder appears while this one converts
        out.mkdir()
        (out / "config.json").write_text("{}")
        return real_mkdtemp(*args, **kwargs)

    monkeypatch.setattr(convert.tempfile, "mkdtemp", other_process_finishes)
    assert convert.convert_gguf_preset(PRESETS["smollm2-135m"], out) == out
    assert (out / "config.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]
