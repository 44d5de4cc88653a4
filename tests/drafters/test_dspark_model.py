"""DSpark / DFlash draft model: heads, masks, loss, training/inference agreement, greedy losslessness."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.drafters.base import NoDrafter
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.config import DSparkConfig, resolve_mask_token_id
from dspark.drafters.dspark.model import DSparkOutputs
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.drafters.dspark.blocks import sample_anchors
from dspark.training.trainer import with_loss
from tests.tiny import tiny_target

from .tiny_drafters import (
    LAYER_IDS,
    overfit_on_greedy,
    random_tokens,
    request_after,
    sample_for,
    tiny_dflash,
    tiny_dspark,
    training_loss,
)

VARIANTS = {
    "dspark": lambda t: tiny_dspark(t),
    "dspark-rnn": lambda t: tiny_dspark(t, markov_head_type="rnn"),
    "dspark-gated": lambda t: tiny_dspark(t, markov_head_type="gated"),  # DeepSpec's gated Markov head
    "dspark-no-markov-conf": lambda t: tiny_dspark(t, confidence_head_with_markov=False),
    "dflash": lambda t: tiny_dflash(t),
}


# --------------------------------------------------------------------------- config


def test_config_presets_and_validation():
    d = DSparkConfig.dflash(block_size=5)
    assert (d.markov_rank, d.enable_confidence_head, d.ce_loss_alpha, d.l1_loss_alpha, d.confidence_head_alpha) == (
        0, False, 1.0, 0.0, 0.0)
    assert d.block_size == 5 and d.is_dflash
    with pytest.raises(ValueError, match="unknown DSpark config keys"):
        DSparkConfig.from_dict({"block_size": 7, "blok_size": 3})
    with pytest.raises(ValueError, match="unknown"):
        DSparkConfig.dflash(bogus=1)
    with pytest.raises(ValueError, match="markov_head_type"):
        DSparkConfig(markov_head_type="gru")
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        DSparkConfig(markov_rank=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        DSparkConfig(target_layer_ids=[3, 1])


def test_mask_token_id_default(tiny):
    assert resolve_mask_token_id(tiny) == tiny.vocab_size - 1  # no tokenizer
    model = tiny_dspark(tiny)
    assert model.config.mask_token_id == tiny.vocab_size - 1
    assert model.config.target_layer_ids == LAYER_IDS


def test_frozen_copies_and_trainable_parameters(tiny):
    model = tiny_dspark(tiny)
    assert torch.equal(model.lm_head.weight, tiny.model.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, tiny.model.model.embed_tokens.weight)
    trainable = {id(p) for p in model.trainable_parameters()}
    assert id(model.lm_head.weight) not in trainable and id(model.embed_tokens.weight) not in trainable
    assert id(model.fc.weight) in trainable and id(model.markov_head.markov_w1.weight) in trainable
    assert all(p.requires_grad for p in model.trainable_parameters())


# --------------------------------------------------------------------------- heads, eqs. (5)-(7)


def test_vanilla_markov_bias_eq5(tiny):
    model = tiny_dspark(tiny)
    hidden = torch.randn(3, tiny.hidden_size)
    prev = torch.tensor([4, 7, 9])
    _, logits, conf = model.head_step(None, hidden, prev)
    mh = model.markov_head
    bias = mh.markov_w1.weight[prev] @ mh.markov_w2.weight.T  # W1[x_{k-1}] W2
    assert torch.allclose(logits, model.lm_head(hidden) + bias, atol=1e-5)
    feats = torch.cat([hidden, mh.markov_w1.weight[prev]], dim=-1)  # eq. (7): [h_k; W1[x_{k-1}]]
    ref = feats @ model.confidence_head.proj.weight[0] + model.confidence_head.proj.bias[0]
    assert torch.allclose(conf, ref, atol=1e-5)


def test_rnn_head_eq6(tiny):
    model = tiny_dspark(tiny, markov_head_type="rnn")
    mh, r = model.markov_head, model.config.markov_rank
    hidden = torch.randn(2, 2, tiny.hidden_size)  # (N, steps, H)
    prev = torch.tensor([[3, 5], [8, 2]])
    state = torch.zeros(2, r)  # s_0 = 0
    W, b = mh.joint_proj.weight, mh.joint_proj.bias
    st = None
    for k in range(2):
        z = torch.cat([state, mh.markov_w1.weight[prev[:, k]], hidden[:, k]], dim=-1)
        g = torch.sigmoid(z @ W[:r].T + b[:r])
        c = torch.tanh(z @ W[r : 2 * r].T + b[r : 2 * r])
        o = torch.tanh(z @ W[2 * r :].T + b[2 * r :])
        state = g * state + (1 - g) * c
        st, logits, _ = model.head_step(st, hidden[:, k], prev[:, k])
        assert torch.allclose(st, state, atol=1e-5)
        assert torch.allclose(logits, model.lm_head(hidden[:, k]) + o @ mh.markov_w2.weight.T, atol=1e-4)
    # teacher-forced unrolling gives the same latents as stepping
    lat = mh.latents(hidden, prev)
    assert torch.allclose(model.markov_head.bias(lat[:, 1]), logits - model.lm_head(hidden[:, 1]), atol=1e-4)


# --------------------------------------------------------------------------- attention mask property


def test_block_ignores_context_at_and_after_its_anchor_and_other_blocks(tiny):
    model = tiny_dspark(tiny)
    tokens = random_tokens(24, seed=3)
    sample = sample_for(tiny, tokens, LAYER_IDS)
    anchors = torch.tensor([6, 14])
    base = model.block_outputs(sample, anchors)

    # change target features at positions >= 6: block 0 unchanged, block 1 (anchor 14) changes
    feats = sample.target_features.clone()
    feats[6:] += torch.randn_like(feats[6:])
    changed = model.block_outputs(type(sample)(sample.input_ids, sample.loss_mask, feats, sample.target_last_hidden),
                                  anchors)
    assert torch.allclose(changed.hidden[0], base.hidden[0], atol=1e-6)
    assert not torch.allclose(changed.hidden[1], base.hidden[1], atol=1e-3)

    # negative control: a feature strictly before anchor 6 does change block 0
    feats = sample.target_features.clone()
    feats[5] += 1.0
    changed = model.block_outputs(type(sample)(sample.input_ids, sample.loss_mask, feats, sample.target_last_hidden),
                                  anchors)
    assert not torch.allclose(changed.hidden[0], base.hidden[0], atol=1e-3)

    # change block 1's anchor token (its input): block 0 unchanged, block 1 changes
    ids = sample.input_ids.clone()
    ids[14] = (ids[14] + 1) % tiny.vocab_size
    changed = model.block_outputs(type(sample)(ids, sample.loss_mask, sample.target_features,
                                               sample.target_last_hidden), anchors)
    assert torch.allclose(changed.hidden[0], base.hidden[0], atol=1e-6)
    assert not torch.allclose(changed.hidden[1], base.hidden[1], atol=1e-3)


def test_packed_blocks_equal_blocks_run_alone(tiny):
    model = tiny_dspark(tiny)
    sample = sample_for(tiny, random_tokens(20, seed=4), LAYER_IDS)
    both = model.block_logits(sample, torch.tensor([3, 11]))
    alone = model.block_logits(sample, torch.tensor([11]))
    assert torch.allclose(both[1], alone[0], atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sandwich norms on the zeroed branches
def test_grown_layers_leave_the_outputs_unchanged_until_trained(arch, tmp_path):
    target = tiny_target(**TARGETS[arch])
    model = tiny_dspark(target)
    sample = sample_for(target, random_tokens(20, seed=4), LAYER_IDS)
    anchors = torch.tensor([3, 11])
    before = model.block_logits(sample, anchors)
    model.grow(3)
    assert len(model.layers) == 3 and model.config.num_draft_layers == 3 and model.spec.num_layers == 3
    assert torch.equal(model.block_logits(sample, anchors), before)
    assert torch.equal(model.layers[2].self_attn.q_proj.weight, model.layers[0].self_attn.q_proj.weight)  # copies
    model.save_checkpoint(tmp_path / "grown")
    loaded = type(model).from_checkpoint(tmp_path / "grown", target)
    assert len(loaded.layers) == 3 and torch.equal(loaded.block_logits(sample, anchors), before)
    with torch.no_grad():  # negative control: once the new layer's output projection moves, so do the outputs
        model.layers[2].self_attn.o_proj.weight.normal_(0, 0.05)
    assert not torch.allclose(model.block_logits(sample, anchors), before, atol=1e-4)
    with pytest.raises(ValueError, match="cannot grow a 3-layer drafter to 2"):
        model.grow(2)


# --------------------------------------------------------------------------- training == inference


TARGETS = {
    "llama": {},
    "qwen3": {"model_type": "qwen3"},  # q_norm / k_norm in the draft layers
    "gemma2": {"model_type": "gemma2", "final_logit_softcapping": 30.0},  # sandwich norms, soft-capping
}


EXTRA_VARIANTS = {
    "dspark-2-layers": lambda t: tiny_dspark(t, num_draft_layers=2),
    "dspark-qwen3-layer": lambda t: tiny_dspark(t, draft_layer="qwen3"),  # Qwen3-shaped whatever the target
    "dflash-anchor-plus-k": lambda t: tiny_dflash(t, slot_offset=1, draft_layer="qwen3"),  # vLLM's DFlash
    "dspark-anchor-plus-k": lambda t: tiny_dspark(t, slot_offset=1),
    "dspark-rnn-anchor-plus-k": lambda t: tiny_dspark(t, slot_offset=1, markov_head_type="rnn"),
}


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("variant", [*VARIANTS, *EXTRA_VARIANTS])
def test_training_forward_matches_propose_distributions(arch, variant):
    """Teacher-forced training logits on prompt+drafts equal the distributions propose sampled from."""
    tiny = tiny_target(**TARGETS[arch])
    model = {**VARIANTS, **EXTRA_VARIANTS}[variant](tiny)
    drafter = DSparkDrafter(model)
    s = model.config.slot_offset  # draft k comes from slot k + s
    G = model.config.num_drafts
    prompt = random_tokens(9, seed=5)
    req = request_after(tiny, prompt, LAYER_IDS, SamplingParams(temperature=1.0, seed=1))
    block = drafter.propose([req], [G])
    drafts = block.tokens[0].tolist()

    sample = sample_for(tiny, prompt + drafts, LAYER_IDS)
    anchor = torch.tensor([len(prompt) - 1])
    out = model.block_outputs(sample, anchor)
    assert out.blocks.labels[0, s:].tolist() == drafts  # slot k predicts anchor + k + 1 - s
    assert bool(out.blocks.eval_mask[0, s:].all()) and not bool(out.blocks.eval_mask[0, :s].any())
    latents = None if out.latents is None else out.latents[:, s:]
    train_probs = torch.softmax(model.draft_logits(out.hidden[:, s:], latents)[0], dim=-1)  # (G, V)
    assert torch.allclose(train_probs, block.draft_probs[0], atol=1e-5)
    if model.confidence_head is not None:
        assert torch.allclose(out.confidence_logits[0, s:], block.confidence_logits[0], atol=1e-4)
    else:
        assert block.confidence_logits is None


def test_propose_incremental_context_equals_fresh(tiny):
    """Projecting only new context rows (cached) gives the same block as projecting everything anew."""
    model = tiny_dspark(tiny)
    drafter = DSparkDrafter(model)
    tokens = random_tokens(12, seed=6)
    req = request_after(tiny, tokens[:7], LAYER_IDS, SamplingParams(temperature=0.0))
    drafter.propose([req], [4])
    # the loop commits 5 more tokens and appends their features
    full = request_after(tiny, tokens, LAYER_IDS, SamplingParams(temperature=0.0))
    req.tokens, req.context_features = list(tokens), full.context_features
    cached = drafter.propose([req], [4])
    fresh = drafter.propose([full], [4])
    assert torch.equal(cached.tokens, fresh.tokens)
    assert torch.allclose(cached.draft_probs, fresh.draft_probs, atol=1e-6)


@torch.inference_mode()  # as propose runs it
def test_requests_catching_up_together_equal_each_alone(tiny):
    """After steps that skipped the drafter, requests catch up on different numbers of new context rows (one none,
    one its whole prompt) in one projection: each request's keys and values are those it gets caught up alone."""
    model = tiny_dspark(tiny)
    prompts = [random_tokens(n, seed=30 + n) for n in (9, 14, 6)]
    seen = [4, 14, 0]  # context rows each request's drafter state already holds; 0 = never drafted

    def requests(drafter):
        reqs = []
        for tokens, k in zip(prompts, seen):
            if k:  # the drafter saw the first k - 1 context rows at an earlier step
                early = request_after(tiny, tokens[:k], LAYER_IDS, SamplingParams(temperature=0.0))
                drafter._context_caches([early])
                req = request_after(tiny, tokens, LAYER_IDS, SamplingParams(temperature=0.0))
                req.draft_state = early.draft_state
            else:
                req = request_after(tiny, tokens, LAYER_IDS, SamplingParams(temperature=0.0))
            reqs.append(req)
        return reqs

    together_drafter, alone_drafter = DSparkDrafter(model), DSparkDrafter(model)
    together = together_drafter._context_caches(requests(together_drafter))
    alone = [alone_drafter._context_caches([req])[0] for req in requests(alone_drafter)]
    for a, b, tokens in zip(together, alone, prompts):
        n = len(tokens) - 1
        assert a.length == b.length == n
        torch.testing.assert_close(a.keys[:, :, :n], b.keys[:, :, :n])  # matmuls of other shapes: ulps
        torch.testing.assert_close(a.values[:, :, :n], b.values[:, :, :n])


def test_propose_shapes_per_request_limits_and_processing(tiny):
    drafter = DSparkDrafter(tiny_dspark(tiny), block_size=3)
    reqs = [
        request_after(tiny, random_tokens(5, seed=7), LAYER_IDS, SamplingParams(temperature=0.7, top_k=5, seed=2)),
        request_after(tiny, random_tokens(9, seed=8), LAYER_IDS, SamplingParams(temperature=1.0, top_p=0.5, seed=3)),
    ]
    block = drafter.propose(reqs, [1, 7])
    assert block.num_tokens.tolist() == [1, 3] and block.tokens.shape == (2, 3)
    assert torch.equal(block.draft_probs[0, 1:], torch.zeros(2, tiny.vocab_size))
    assert (block.draft_probs[0, 0] > 0).sum() <= 5  # top-k applied to the draft as to the target
    for r, n in enumerate([1, 3]):
        for k in range(n):
            assert block.draft_probs[r, k].sum().item() == pytest.approx(1.0, abs=1e-5)
            assert block.draft_probs[r, k, block.tokens[r, k]] > 0
    with pytest.raises(ValueError, match="trained with block_size"):
        DSparkDrafter(tiny_dspark(tiny), block_size=9)


@torch.inference_mode()
def _propose_slowly(drafter: DSparkDrafter, req, n: int) -> tuple[list[int], torch.Tensor]:
    """One request's block the slow way: the head step by step, each token from ``logits_to_probs`` and
    ``sample_from_probs`` with the request's generator (the per-request loop the batched propose replaced)."""
    from dspark.modeling.attention import BatchLayout
    from dspark.sampling.processing import logits_to_probs, sample_from_probs

    m, G = drafter.model, drafter.model.config.block_size
    block = drafter.propose([req], [0])  # nothing drafted: only the request's context cache is brought up to date
    assert block.tokens.numel() == 0
    cache = drafter._context_caches([req])[0]
    cache.reserve(G)
    layout = BatchLayout.build([G], [cache], torch.device("cpu"), causal=False)
    ids = torch.full((1, G), m.config.mask_token_id, dtype=torch.long)
    ids[0, 0] = req.anchor
    hidden = m.backbone(m.embed(ids.view(-1)), layout.positions, [], layout).view(1, G, -1)[:, m.config.slot_offset:]
    prev, state, tokens, probs_out = torch.tensor([req.anchor]), None, [], torch.zeros(n, drafter.vocab_size)
    for k in range(n):
        base = m.base_logits(hidden[:, k])
        cand = None if not drafter.head_top_m else base.topk(drafter.head_top_m, dim=-1).indices
        state, logits, _ = m.head_step(state, hidden[:, k], prev, base, cand)
        s = req.sampling
        probs = logits_to_probs(logits[0], s.temperature, s.top_k, s.top_p)
        w = int(sample_from_probs(probs, req.generator))
        tok = w if drafter.draft_vocab is None else int(drafter.draft_vocab[w])
        tokens.append(tok)
        if drafter.draft_vocab is None:
            probs_out[k] = probs
        else:
            probs_out[k, drafter.draft_vocab] = probs
        prev = torch.tensor([tok])
    return tokens, probs_out


@pytest.mark.parametrize("options", [{}, {"head_top_m": 5}, {"draft_vocab": list(range(0, 96, 2))}],
                         ids=["all-tokens", "top-m", "draft-vocab"])
def test_batched_propose_is_each_request_drafted_alone_the_slow_way(tiny, options):
    """Mixed settings, per-request limits and generators (two requests share the global one): the greedy request
    and every seeded one get the tokens and distributions of a per-request loop over the head (the same random
    stream); a request with no drafts gets none."""
    model = tiny_dspark(tiny)
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5),
                SamplingParams(temperature=0.7, top_k=5, seed=6), SamplingParams(temperature=1.0, top_p=0.6, seed=7),
                SamplingParams(temperature=1.0)]
    limits = [4, 2, 4, 0, 3]

    def requests():
        torch.manual_seed(11)  # the unseeded requests draw from the global generator, in request order
        return [request_after(tiny, random_tokens(5 + 2 * i, seed=20 + i), LAYER_IDS, sp)
                for i, sp in enumerate(settings)]

    block = DSparkDrafter(model, **options).propose(requests(), limits)
    slow_drafter, reqs = DSparkDrafter(model, **options), requests()
    assert block.num_tokens.tolist() == limits
    full = block.probs_over_vocabulary(list(range(len(reqs))), block.max_tokens, tiny.vocab_size)  # (R, K, V)
    for r, req in enumerate(reqs):  # requests with their own generators: alone is the same stream
        if settings[r].seed is None or limits[r] == 0:
            continue
        tokens, probs = _propose_slowly(slow_drafter, req, limits[r])
        assert block.tokens[r, :limits[r]].tolist() == tokens
        torch.testing.assert_close(full[r, :limits[r]], probs)  # matmuls of other shapes: ulps
    assert torch.equal(full[3], torch.zeros_like(full[3]))  # drafted nothing
    greedy_tokens, greedy_probs = _propose_slowly(slow_drafter, reqs[0], limits[0])  # probs: one-hot rows
    assert block.tokens[0].tolist() == greedy_tokens == greedy_probs.argmax(-1).tolist()
    assert torch.equal(full[0], torch.zeros_like(full[0]))  # left 0: verification compares a greedy row's tokens


# --------------------------------------------------------------------------- loss by hand


@pytest.mark.parametrize("variant", ["dspark", "dspark-rnn", "dflash"])
def test_training_loss_matches_hand_computation(tiny, variant):
    model = VARIANTS[variant](tiny)
    cfg = model.config
    tokens = random_tokens(30, seed=9)
    loss_mask = [0] * 8 + [1] * 14 + [0] * 2 + [1] * 6
    sample = sample_for(tiny, tokens, LAYER_IDS, loss_mask)
    loss, metrics = training_loss(model, sample, torch.Generator().manual_seed(11))

    anchors = sample_anchors(sample.loss_mask, cfg.num_anchors, torch.Generator().manual_seed(11))
    out = model.block_outputs(sample, anchors)
    logits = model.draft_logits(out.hidden, out.latents)  # (A, G, V)
    b = out.blocks
    total_w = ce_num = l1_num = bce_num = 0.0
    acc_sum = [0.0] * cfg.block_size
    acc_cnt = [0] * cfg.block_size
    for a in range(b.num_blocks):
        for k in range(cfg.block_size):
            if not b.eval_mask[a, k]:
                continue
            w = math.exp(-k / cfg.loss_decay_gamma)
            draft = torch.softmax(logits[a, k], -1)
            target = torch.softmax(tiny.model.logits(sample.target_last_hidden[b.anchors[a] + k]), -1)
            ce = -math.log(draft[b.labels[a, k]].item())
            l1 = (draft - target).abs().sum().item()
            soft = min(max(1 - l1 / 2, 0.0), 1.0)
            total_w += w
            ce_num += w * ce
            l1_num += w * l1
            acc_sum[k] += soft
            acc_cnt[k] += 1
            if out.confidence_logits is not None:
                c = 1 / (1 + math.exp(-out.confidence_logits[a, k].item()))
                bce_num += w * -(soft * math.log(c) + (1 - soft) * math.log(1 - c))
    assert total_w > 0
    expected = (cfg.ce_loss_alpha * ce_num + cfg.l1_loss_alpha * l1_num + cfg.confidence_head_alpha * bce_num) / total_w
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert metrics["ce"] == pytest.approx(ce_num / total_w, rel=1e-4)
    assert metrics["l1"] == pytest.approx(l1_num / total_w, rel=1e-4)
    for k in range(cfg.block_size):
        if acc_cnt[k]:
            assert metrics[f"acc@{k}"] == pytest.approx(acc_sum[k] / acc_cnt[k], rel=1e-4)
    loss.backward()
    grads = [p.grad for p in model.trainable_parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.lm_head.weight.grad is None and model.embed_tokens.weight.grad is None


def test_training_loss_without_anchors_is_a_connected_zero(tiny):
    model = tiny_dspark(tiny)
    sample = sample_for(tiny, random_tokens(10, seed=2), LAYER_IDS, [0] * 10)
    loss, metrics = training_loss(model, sample, torch.Generator().manual_seed(0))
    assert loss.item() == 0.0 and metrics["num_blocks"] == 0.0
    loss.backward()
    assert all(p.grad is not None for p in model.trainable_parameters())


def test_a_few_steps_reduce_the_loss(tiny):
    """Sanity: Adam on one sequence lowers the loss (the maths trains); fixed seeds."""
    model = tiny_dspark(tiny, num_anchors=8)
    sample = sample_for(tiny, random_tokens(24, seed=12), LAYER_IDS)
    opt = torch.optim.Adam(model.trainable_parameters(), lr=3e-3)
    first = None
    for step in range(15):
        loss, _ = training_loss(model, sample, torch.Generator().manual_seed(0))
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first


# --------------------------------------------------------------------------- losslessness (greedy)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_speculative_equals_plain_greedy(tiny, variant):
    """Untrained drafters (almost nothing accepted) and drafters overfitted to the target's own output
    (many drafts accepted: exercises cache rollback and context growth) both reproduce plain greedy."""
    prompts = [random_tokens(6, seed=13), random_tokens(11, seed=14)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    plain = SpeculativeGenerator(tiny, NoDrafter(tiny.vocab_size)).generate(prompts, sp)
    untrained = SpeculativeGenerator(tiny, DSparkDrafter(VARIANTS[variant](tiny))).generate(prompts, sp)
    model = VARIANTS[variant](tiny)
    overfit_on_greedy(tiny, model, prompts[0])
    trained = SpeculativeGenerator(tiny, DSparkDrafter(model)).generate(prompts, sp)
    for a, b, c in zip(plain, untrained, trained):
        assert a.output_ids == b.output_ids == c.output_ids
    assert trained[0].stats.acceptance_length > 1.5  # the accept path really ran


def test_forward_is_training_loss_and_config_round_trips(tiny):
    """DDP wraps the trainer's ``DrafterWithLoss``; its ``forward`` must be the training loss, while the
    model's own forward returns outputs only."""
    model = tiny_dspark(tiny)
    sample = sample_for(tiny, random_tokens(16, seed=15), LAYER_IDS)
    a, _ = with_loss(model)(sample, torch.Generator().manual_seed(1))
    b, _ = training_loss(model, sample, torch.Generator().manual_seed(1))
    assert a.item() == b.item()
    assert isinstance(model(sample, torch.Generator().manual_seed(1)), DSparkOutputs)
    assert DSparkConfig.from_dict(model.config.to_dict()) == model.config


# --------------------------------------------------------------------------- head restricted to top-M candidates


@pytest.mark.parametrize("variant", ["dspark", "dspark-rnn"])
def test_head_step_with_candidates_is_the_full_step_restricted(tiny, variant):
    model = VARIANTS[variant](tiny)
    N, V = 3, tiny.vocab_size
    torch.manual_seed(0)
    hidden, prev = torch.randn(N, model.spec.hidden_size), torch.randint(0, V, (N,))
    base = model.base_logits(hidden)
    _, full, _ = model.head_step(None, hidden, prev, base)
    everything = torch.arange(V).expand(N, V)
    _, same, _ = model.head_step(None, hidden, prev, base, everything)
    torch.testing.assert_close(same, full)
    cand = base.topk(5, dim=-1).indices  # (N, 5)
    _, part, _ = model.head_step(None, hidden, prev, base, cand)
    torch.testing.assert_close(part.gather(-1, cand), full.gather(-1, cand))
    outside = torch.ones(N, V, dtype=torch.bool).scatter_(-1, cand, False)
    assert torch.isinf(part[outside]).all() and (part[outside] < 0).all()


@pytest.mark.parametrize("variant", ["dspark", "dspark-rnn", "dflash"])
def test_head_top_m_drafts_stay_lossless_and_inside_the_top_m(tiny, variant):
    prompts = [random_tokens(6, seed=13), random_tokens(11, seed=14)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = SpeculativeGenerator(tiny, NoDrafter(tiny.vocab_size)).generate(prompts, sp)
    model = VARIANTS[variant](tiny)
    overfit_on_greedy(tiny, model, prompts[0])
    drafter = DSparkDrafter(model, head_top_m=3)
    assert drafter.head_top_m == (None if variant == "dflash" else 3)  # DFlash has no head to restrict
    fast = SpeculativeGenerator(tiny, drafter).generate(prompts, sp)
    assert [r.output_ids for r in fast] == [r.output_ids for r in plain]
    req = request_after(tiny, prompts[1], LAYER_IDS, SamplingParams(temperature=1.0, seed=4))
    block = drafter.propose([req], [model.config.block_size])
    support = (block.draft_probs[0] > 0).sum(-1)  # (G,)
    assert (support <= 3).all() if variant != "dflash" else (support == tiny.vocab_size).all()
    with pytest.raises(ValueError, match="head_top_m"):
        DSparkDrafter(model, head_top_m=0)


# --------------------------------------------------------------------------- the decoding fast paths


def test_a_greedy_draft_is_the_argmax_of_the_whole_row_ties_included():
    """``_first_best`` reads the M candidates' scores only and must pick what the argmax over the W-wide row (the
    scores at the candidates, -inf elsewhere) picks: the smallest index among tied best scores."""
    from dspark.drafters.dspark.drafter import _first_best

    g = torch.Generator().manual_seed(3)
    W, M = 50, 6
    for _ in range(200):
        cand = torch.stack([torch.randperm(W, generator=g)[:M] for _ in range(4)])  # (4, M)
        scores = torch.randint(0, 3, (4, M), generator=g).to(torch.bfloat16)  # few values: ties are common
        row = torch.full((4, W), float("-inf"), dtype=torch.bfloat16).scatter(-1, cand, scores)
        assert _first_best(scores, cand).tolist() == row.float().argmax(-1).tolist()
    full = torch.randn(3, W, generator=g)
    assert torch.equal(_first_best(full, None), full.argmax(-1))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (prepacked CPU weights)")
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 8), (torch.bfloat16, 8), (torch.bfloat16, 16)])
def test_the_decoding_layout_drafts_what_the_trained_layout_drafts(dtype, head_dim):
    """A drafter loaded for decoding (fused projections, CPU kernels where built, prepacked weights) proposes the
    greedy tokens of the same model in its trained layout, confidences within rounding, and refuses to be saved.
    Heads of 16 take the C attention kernel in bf16 (every block of the batch in one call)."""
    import copy

    from dspark.modeling.packed import pack_all_linears

    tiny = tiny_target(head_dim=head_dim)
    model = tiny_dspark(tiny).to(dtype)
    fast = copy.deepcopy(model)
    fast.use_cpu_kernels()  # bf16: norms, residual adds and attention through the C kernels, where built
    pack_all_linears(fast)
    assert fast.layers[0].self_attn.kv_proj is not None and fast.layers[0].mlp.gate_up_proj is not None
    greedy = SamplingParams(temperature=0.0)

    def requests():
        return [request_after(tiny, random_tokens(6 + 3 * i, seed=40 + i), LAYER_IDS, greedy) for i in range(3)]

    with torch.inference_mode():
        plain = DSparkDrafter(model).propose(requests(), [4, 2, 4])
        decoding = DSparkDrafter(fast).propose(requests(), [4, 2, 4])
    assert torch.equal(plain.tokens, decoding.tokens)
    tol = 1e-4 if dtype == torch.float32 else 0.05  # bf16: the kernels round a norm by one step now and then
    torch.testing.assert_close(plain.confidence_logits, decoding.confidence_logits, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="loaded for decoding"):
        fast.save_checkpoint("unused")
