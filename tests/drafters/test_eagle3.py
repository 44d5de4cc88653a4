"""Eagle3 draft model: TTT attention, loss, training/inference agreement, greedy losslessness."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import NoDrafter
from dspark.drafters.eagle3.drafter import Eagle3Drafter
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.model import ttt_attention
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from tests.tiny import tiny_target

from .tiny_drafters import (
    LAYER_IDS,
    overfit_on_greedy,
    random_tokens,
    request_after,
    sample_for,
    tiny_eagle3,
    training_loss,
)


def test_config_validation():
    assert Eagle3Config().ttt_length == 7 and Eagle3Config().step_loss_decay == 0.8
    with pytest.raises(ValueError, match="unknown Eagle3 config keys"):
        Eagle3Config.from_dict({"ttt_lenght": 3})
    with pytest.raises(ValueError, match="step_loss_decay"):
        Eagle3Config(step_loss_decay=0.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        Eagle3Config(target_layer_ids=[2, 2])


def test_frozen_copies_and_layer_names(tiny):
    model = tiny_eagle3(tiny)
    assert torch.equal(model.lm_head.weight, tiny.model.lm_head.weight)
    names = set(model.state_dict())
    for key in ("fc.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
                "layers.0.self_attn.q_proj.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight"):
        assert key in names
    assert model.layers[0].self_attn.q_proj.weight.shape[1] == 2 * tiny.hidden_size  # [embed; hidden]
    assert id(model.lm_head.weight) not in {id(p) for p in model.trainable_parameters()}


def test_ttt_attention_matches_explicit_mask(tiny):
    """Query i at step s sees step-0 keys j <= i and its own (diagonal) keys of steps 1..s."""
    attn = tiny_eagle3(tiny).layers[0].self_attn
    L, s = 5, 2
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, Hq, D, generator=g)
    keys = [torch.randn(L, Hkv, D, generator=g) for _ in range(s + 1)]
    values = [torch.randn(L, Hkv, D, generator=g) for _ in range(s + 1)]
    got = ttt_attention(attn, q, keys, values)
    # reference: all keys concatenated [step 0 | step 1 | step 2], explicit boolean mask
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    mask = torch.cat([j <= i] + [j == i] * s, dim=1)  # (L, (s+1) L)
    k_all = torch.cat(keys).transpose(0, 1)  # (Hkv, (s+1) L, D)
    v_all = torch.cat(values).transpose(0, 1)
    ref = attn.attend(q.transpose(0, 1), k_all, v_all, mask)
    assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_steps_match_the_inference_chain(arch, layers):
    """TTT step s at position n-1 (teacher-forced with the drafts) equals the chain's draft s distribution."""
    tiny = tiny_target(model_type=arch)
    model = tiny_eagle3(tiny, ttt_length=3, block_size=3, draft_num_hidden_layers=layers)
    drafter = Eagle3Drafter(model)
    prompt = random_tokens(8, seed=5)
    req = request_after(tiny, prompt, LAYER_IDS, SamplingParams(temperature=1.0, seed=4))
    block = drafter.propose([req], [3])
    drafts = block.tokens[0].tolist()
    sample = sample_for(tiny, prompt + drafts, LAYER_IDS)
    hidden = model.ttt_hidden_states(sample)
    i = len(prompt) - 2  # entry n-1: feature of the last fed position, token = the anchor
    for s in range(3):
        train_probs = torch.softmax(model.logits(hidden[s][i : i + 1])[0], -1)
        assert torch.allclose(train_probs, block.draft_probs[0, s], atol=1e-5), s


def test_training_loss_matches_hand_computation(tiny):
    model = tiny_eagle3(tiny, ttt_length=3)
    tokens = random_tokens(14, seed=6)
    loss_mask = [0] * 4 + [1] * 10
    sample = sample_for(tiny, tokens, LAYER_IDS, loss_mask)
    loss, metrics = training_loss(model, sample)
    hidden = model.ttt_hidden_states(sample)
    L = len(tokens)
    expected = 0.0
    for s in range(3):
        step = 0.0
        for i in range(L):
            j = i + s  # step s at position i uses loss_mask[i+s], needs a next position
            if j >= L - 1 or not loss_mask[j]:
                continue
            target = torch.softmax(tiny.model.logits(sample.target_last_hidden[i + 1 + s]), -1)
            logp = torch.log_softmax(model.logits(hidden[s][i : i + 1])[0], -1)
            step += -(target * logp).sum().item()
        expected += 0.8**s * step / L
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert set(metrics) >= {"acc@0", "acc@1", "acc@2", "loss", "tau"}
    loss.backward()
    assert all(p.grad is not None for p in model.trainable_parameters())
    assert model.lm_head.weight.grad is None


def test_propose_incremental_cache_equals_fresh(tiny):
    drafter = Eagle3Drafter(tiny_eagle3(tiny))
    tokens = random_tokens(12, seed=7)
    req = request_after(tiny, tokens[:6], LAYER_IDS, SamplingParams(temperature=0.0))
    drafter.propose([req], [3])
    full = request_after(tiny, tokens, LAYER_IDS, SamplingParams(temperature=0.0))
    req.tokens, req.context_features = list(tokens), full.context_features
    cached = drafter.propose([req], [3])
    again = drafter.propose([req], [3])  # nothing committed in between: same proposal
    fresh = drafter.propose([full], [3])
    assert torch.equal(cached.tokens, fresh.tokens) and torch.equal(again.tokens, fresh.tokens)
    assert torch.allclose(cached.draft_probs, fresh.draft_probs, atol=1e-6)
    assert req.draft_state.length == len(tokens) - 1  # chain entries rolled back


def test_propose_per_request_limits(tiny):
    drafter = Eagle3Drafter(tiny_eagle3(tiny), block_size=3)
    reqs = [request_after(tiny, random_tokens(5, seed=8), LAYER_IDS),
            request_after(tiny, random_tokens(7, seed=9), LAYER_IDS),
            request_after(tiny, random_tokens(4, seed=10), LAYER_IDS)]
    block = drafter.propose(reqs, [2, 5, 0])
    assert block.num_tokens.tolist() == [2, 3, 0] and block.tokens.shape == (3, 3)
    assert torch.equal(block.draft_probs[0, 2], torch.zeros(tiny.vocab_size))
    assert torch.equal(block.draft_probs[2], torch.zeros(3, tiny.vocab_size))
    assert block.draft_probs[1].sum(-1).allclose(torch.ones(3))


def test_greedy_speculative_equals_plain_greedy(tiny):
    prompts = [random_tokens(6, seed=13), random_tokens(11, seed=14)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    plain = SpeculativeGenerator(tiny, NoDrafter(tiny.vocab_size)).generate(prompts, sp)
    untrained = SpeculativeGenerator(tiny, Eagle3Drafter(tiny_eagle3(tiny))).generate(prompts, sp)
    model = tiny_eagle3(tiny)
    overfit_on_greedy(tiny, model, prompts[0])
    trained = SpeculativeGenerator(tiny, Eagle3Drafter(model)).generate(prompts, sp)
    for a, b, c in zip(plain, untrained, trained):
        assert a.output_ids == b.output_ids == c.output_ids
    assert trained[0].stats.acceptance_length > 1.3  # drafts were accepted


def test_loss_without_supervised_tokens_is_a_connected_zero(tiny):
    model = tiny_eagle3(tiny)
    sample = sample_for(tiny, random_tokens(8, seed=3), LAYER_IDS, [0] * 8)
    loss, _ = training_loss(model, sample)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None for p in model.trainable_parameters())


def test_a_drafter_that_cannot_export_warns_when_it_is_made(tiny):
    """Both engines' LlamaForCausalLMEagle3 fuse exactly 3 target layers: other counts warn at train time (the
    export would refuse them); the 3-layer drafter, and the export preset, do not."""
    with pytest.warns(UserWarning, match="exactly 3"):
        tiny_eagle3(tiny, target_layer_ids=[0, 3])
    import warnings

    from dspark.training.config import load_config

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_eagle3(tiny, target_layer_ids=[0, 2, 3])
    preset = load_config("smollm2-eagle3-export")
    assert len(preset.model["target_layer_ids"]) == 3


def _mixed_requests(tiny):
    """Three requests of different lengths and settings: greedy, temperature 1, temperature 0.7 with top-k."""
    settings = [SamplingParams(temperature=0.0, max_new_tokens=16),
                SamplingParams(temperature=1.0, max_new_tokens=16, seed=11),
                SamplingParams(temperature=0.7, top_k=5, max_new_tokens=16, seed=12)]
    return [request_after(tiny, random_tokens(n, seed=30 + n), LAYER_IDS, s) for n, s in zip((5, 9, 7), settings)]


@pytest.mark.parametrize("separate_pools", [False, True])
def test_a_batch_drafts_what_each_request_drafts_alone(tiny, separate_pools):
    """The batched chain (one attention call per layer over the drafter's pool, sampling in a few tensor
    operations) proposes for each request what it proposes alone; caches of different pools (the per-request
    path) too. Greedy rows leave their draft_probs 0; sampled rows carry the distribution they were drawn from."""
    from dspark.modeling.kv_cache import KVCache

    model = tiny_eagle3(tiny, ttt_length=3, block_size=3)
    want = [3, 2, 3]
    alone = [Eagle3Drafter(model).propose([req], [n]) for req, n in zip(_mixed_requests(tiny), want)]
    reqs = _mixed_requests(tiny)
    if separate_pools:  # each request's draft cache in a pool of its own
        s = model.spec
        for req in reqs:
            req.draft_state = KVCache(s.num_layers, s.num_kv_heads, s.head_dim, 64)
    batch = Eagle3Drafter(model).propose(reqs, want)
    assert batch.num_tokens.tolist() == want
    for r, one in enumerate(alone):
        n = want[r]
        assert torch.equal(batch.tokens[r, :n], one.tokens[0, :n]), r
        assert torch.allclose(batch.draft_probs[r, :n], one.draft_probs[0, :n], atol=1e-6), r
        assert reqs[r].draft_state.length == len(reqs[r].tokens) - 1  # the chain's entries rolled back
    assert torch.equal(batch.draft_probs[0], torch.zeros_like(batch.draft_probs[0]))  # greedy: tokens compared
    assert batch.draft_probs[1, :2].sum(-1).allclose(torch.ones(2))
    assert (batch.draft_probs[2, :3] > 0).sum(-1).le(5).all()  # top-k 5
    if not separate_pools:
        assert len({id(req.draft_state.pool) for req in reqs}) == 1


def test_in_bf16_on_the_cpu_the_chain_attends_through_the_c_kernel_and_a_batch_drafts_what_each_alone(monkeypatch):
    """bf16 decoding on the CPU: every chain pass and catch-up attends in one C kernel call per layer (each row over
    its own positions), a batch proposes bit for bit what each request proposes alone, and the drafts are those of
    torch's attention up to bf16 rounding."""
    from dspark.modeling import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no C compiler here: the kernels are off")
    target = tiny_target(seed=3, head_dim=16)
    target.model.to(torch.bfloat16)
    model = tiny_eagle3(target, ttt_length=3, block_size=3).to(torch.bfloat16)
    calls = []
    attention = cpu_kernels.attention
    monkeypatch.setattr(cpu_kernels, "attention", lambda q, *a: calls.append(q.shape[0]) or attention(q, *a))
    want = [3, 2, 3]
    with torch.inference_mode():
        alone = [Eagle3Drafter(model).propose([req], [n]) for req, n in zip(_mixed_requests(target), want)]
        calls.clear()
        batch = Eagle3Drafter(model).propose(_mixed_requests(target), want)
        assert len(calls) == 3 * len(model.layers)  # the catch-up and two chain passes, one call per layer each
        for r, one in enumerate(alone):
            n = want[r]
            assert torch.equal(batch.tokens[r, :n], one.tokens[0, :n]), r
            assert torch.equal(batch.draft_probs[r, :n], one.draft_probs[0, :n]), r
        monkeypatch.setenv("DSPARK_ATTENTION_KERNEL", "0")  # torch's attention instead
        sdpa = Eagle3Drafter(model).propose(_mixed_requests(target), want)
    assert torch.allclose(sdpa.draft_probs, batch.draft_probs, atol=0.05)
