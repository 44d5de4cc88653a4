"""A draft-vocabulary DSpark checkpoint exported to SGLang (full vocabulary, one more masking Markov rank) drafts
exactly what our drafter drafts: the draft tokens' logits, probability 0 elsewhere, the same greedy drafts and
confidence logits, for every head type SGLang loads, with an anchor outside the draft vocabulary.

The engine side is ``engine_loaders.sglang_dspark`` (what SGLang loads) and ``sglang_dspark_greedy`` (SGLang's
head formulas, restated); our side is the drafter's own ``head_step`` and ``DSparkDrafter.propose``.
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.dspark.vocab import restrict_to_draft_vocab
from dspark.export.engines import OUTSIDE_BIAS, SATURATE, export_for_engine
from dspark.sampling.processing import SamplingParams
from tests.drafters.tiny_drafters import (LAYER_IDS, random_tokens, request_after, sample_for, tiny_dflash,
                                         tiny_dspark)
from tests.tiny import tiny_target

from . import engine_loaders as engines

W = 40  # draft vocabulary of the tiny target's 96 tokens


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target(model_type="qwen3", architectures=["Qwen3ForCausalLM"])


def _bf16_exact(model: DSparkModel) -> DSparkModel:
    """Round the drafter's own weights to bf16 (the export's dtype) so that ours and the export's agree to float32
    rounding; the embedding and LM head stay the target's (SGLang shares them, unrounded)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens.", "lm_head.")):
                p.copy_(p.to(torch.bfloat16).float())
    return model


def _draft_vocab_drafter(target, head: str, tokens: list[int], outside: list[int],
                         inside: tuple[int, ...] = ()) -> DSparkModel:
    """A tiny DSpark drafter restricted to W random tokens: all of ``inside``, none of ``outside``."""
    full = _bf16_exact(tiny_dspark(target, markov_head_type=head))
    g = torch.Generator().manual_seed(1)
    pool = [t for t in torch.randperm(target.vocab_size, generator=g).tolist() if t not in outside + list(inside)]
    ids = sorted([*inside, *pool[:W - len(inside)]], key=lambda t: -tokens.count(t))  # most frequent first, like `dspark data vocab`
    return restrict_to_draft_vocab(full, ids).eval()


def _export(model: DSparkModel, tmp_path, vocab: int) -> engines.Loaded:
    model.save_checkpoint(tmp_path / "ckpt")
    plan, _ = export_for_engine(tmp_path / "ckpt", "sglang", tmp_path / "sgl")
    assert any("full vocabulary" in n for n in plan.notes), plan.notes
    loaded = engines.sglang_dspark(tmp_path / "sgl", vocab, verify_mode="compact")
    assert (loaded.ignored, loaded.unfilled) == ([], [])
    assert loaded.markov_rank == model.config.markov_rank + 1 and loaded.head_type == model.config.markov_head_type
    return loaded


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_sglang_export_of_a_draft_vocabulary_drafts_our_distribution(qwen3, tmp_path, head):
    tokens = random_tokens(16, seed=3)
    anchors = torch.tensor([3, 8, 12])
    outside = [tokens[3], tokens[12]]  # two anchors whose token is outside the draft vocabulary
    model = _draft_vocab_drafter(qwen3, head, tokens, outside, inside=(tokens[8],))
    ids = model.draft_vocab
    assert tokens[8] in ids.tolist() and not set(outside) & set(ids.tolist())
    loaded = _export(model, tmp_path, qwen3.vocab_size)

    with torch.no_grad():
        out = model.block_outputs(sample_for(qwen3, tokens, LAYER_IDS), anchors)
        hidden, anchor = out.hidden, out.blocks.prev_tokens[:, 0]  # (A, G, H), (A,)
        # ours: the drafter's greedy left-to-right head steps over W, each draft the next previous token
        state, prev, ours_logits, ours_drafts, ours_conf = None, anchor, [], [], []
        for k in range(hidden.shape[1]):
            state, logits, conf = model.head_step(state, hidden[:, k], prev)  # (A, W), (A,)
            ours_conf.append(conf)
            prev = ids[logits.argmax(-1)]
            ours_logits.append(logits)
            ours_drafts.append(prev)
        ours_logits, ours_drafts = torch.stack(ours_logits, 1), torch.stack(ours_drafts, 1)  # (A, G, W), (A, G)
    lm_head = qwen3.model.lm_head.weight.detach()  # SGLang shares the target's full LM head
    drafts, logits, conf = engines.sglang_dspark_greedy(loaded, lm_head, hidden, anchor)
    assert torch.equal(drafts, ours_drafts)
    assert torch.allclose(logits[..., ids], ours_logits, atol=1e-4)
    inside = torch.zeros(qwen3.vocab_size, dtype=torch.bool)
    inside[ids] = True
    probs = torch.softmax(logits, -1)
    assert torch.all(probs[..., ~inside] == 0)
    assert torch.allclose(probs[..., ids], torch.softmax(ours_logits, -1), atol=1e-5)
    assert torch.allclose(conf, torch.stack(ours_conf, 1), atol=1e-4)

    # the engine's half-precision dtypes: still exactly 0 outside, nothing overflows
    for dtype in (torch.bfloat16, torch.float16):
        _, half_logits, _ = engines.sglang_dspark_greedy(loaded, lm_head, hidden, anchor, dtype)
        assert torch.isfinite(half_logits).all(), dtype
        assert torch.all(torch.softmax(half_logits, -1)[..., ~inside] == 0), dtype
        assert torch.all(torch.softmax(half_logits.float(), -1)[..., ~inside] == 0), dtype

    # negative control: without the masking column SGLang would draft tokens outside the draft vocabulary
    loaded.params["markov_head.markov_w2.weight"] = loaded.params["markov_head.markov_w2.weight"].clone()
    loaded.params["markov_head.markov_w2.weight"][:, -1] = 0
    unmasked, _, _ = engines.sglang_dspark_greedy(loaded, lm_head, hidden, anchor)
    assert not inside[unmasked].all()


def test_saturating_constants_are_exact_in_every_engine_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.tensor(SATURATE, dtype=dtype)
        assert torch.sigmoid(x).item() == 1.0 and torch.tanh(x).item() == 1.0, dtype
        assert torch.tensor(OUTSIDE_BIAS, dtype=dtype).item() == OUTSIDE_BIAS, dtype


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_our_loader_reads_the_export_back_and_proposes_the_same(qwen3, tmp_path, head):
    """Through our own full-vocabulary drafter (rank r + 1): the same greedy drafts and draft_probs as the
    draft-vocabulary drafter, for a request whose anchor is outside the draft vocabulary."""
    tokens = random_tokens(12, seed=5)
    model = _draft_vocab_drafter(qwen3, head, tokens, outside=[tokens[-1]])
    _export(model, tmp_path, qwen3.vocab_size)
    back = DSparkModel.from_checkpoint(tmp_path / "sgl", qwen3).eval()
    assert back.draft_vocab is None and back.config.markov_rank == model.config.markov_rank + 1
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    a = DSparkDrafter(model).propose([request_after(qwen3, tokens, LAYER_IDS, sampling)], [4])
    b = DSparkDrafter(back).propose([request_after(qwen3, tokens, LAYER_IDS, sampling)], [4])
    assert torch.equal(a.tokens, b.tokens)
    V = qwen3.vocab_size
    assert b.vocab is None and a.vocab is not None  # ours reports over its W tokens, the export over V
    assert torch.equal(a.probs_over_vocabulary([0], 4, V), b.draft_probs)  # greedy: one-hot on the same token
    assert torch.allclose(a.confidence_logits, b.confidence_logits, atol=1e-4)
    # temperature 1: the first slot's distribution (later slots depend on the sampled draft, and one uniform
    # through the inverse CDF picks different tokens over W in draft order and over V in token-id order)
    t = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    a = DSparkDrafter(model).propose([request_after(qwen3, tokens, LAYER_IDS, t)], [1])
    b = DSparkDrafter(back).propose([request_after(qwen3, tokens, LAYER_IDS, t)], [1])
    outside = torch.ones(qwen3.vocab_size, dtype=torch.bool)
    outside[model.draft_vocab] = False
    assert torch.all(b.draft_probs[..., outside] == 0) and b.draft_probs[..., ~outside].sum() > 0.999
    assert torch.allclose(a.probs_over_vocabulary([0], 1, V), b.draft_probs, atol=1e-5)


def test_dflash_with_a_draft_vocabulary_goes_to_sglang_as_a_rank_2_masking_head(qwen3, tmp_path):
    """A DFlash drafter is a DSpark with a zero rank-1 head; with a draft vocabulary the masking rank makes it 2."""
    tokens = random_tokens(12, seed=6)
    ids = [t for t in range(qwen3.vocab_size) if t != tokens[-1]][::2]
    model = restrict_to_draft_vocab(_bf16_exact(tiny_dflash(qwen3)), ids).eval()
    model.save_checkpoint(tmp_path / "ckpt")
    plan, _ = export_for_engine(tmp_path / "ckpt", "sglang", tmp_path / "sgl")
    assert any("zero rank-1" in n for n in plan.notes) and any("full vocabulary" in n for n in plan.notes)
    loaded = engines.sglang_dspark(tmp_path / "sgl", qwen3.vocab_size)  # static verify mode: no confidence head
    assert (loaded.markov_rank, loaded.ignored, loaded.unfilled) == (2, [], [])
    back = DSparkModel.from_checkpoint(tmp_path / "sgl", qwen3).eval()
    t = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    a = DSparkDrafter(model).propose([request_after(qwen3, tokens, LAYER_IDS, t)], [4])
    b = DSparkDrafter(back).propose([request_after(qwen3, tokens, LAYER_IDS, t)], [4])
    # ids ascend, so one uniform through the inverse CDF picks the same token over W and over V: the same drafts
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.probs_over_vocabulary([0], 4, qwen3.vocab_size), b.draft_probs, atol=1e-5)


def test_smollm2_sized_draft_vocabulary_export_is_what_sglang_reads(tmp_path):
    """SmolLM2's vocabulary (49,152), the shipped preset's rank 256 and 8,192 draft tokens, tiny layers."""
    target = tiny_target(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=49152)
    full = tiny_dspark(target, markov_rank=256, block_size=7)
    ids = torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:8192]
    model = restrict_to_draft_vocab(full, ids)
    model.save_checkpoint(tmp_path / "ckpt", torch.bfloat16)
    plan, command = export_for_engine(tmp_path / "ckpt", "sglang", tmp_path / "sgl", target="Qwen/Qwen3-8B")
    loaded = engines.sglang_dspark(tmp_path / "sgl", 49152, verify_mode="compact")
    assert (loaded.ignored, loaded.unfilled, loaded.markov_rank, loaded.gamma) == ([], [], 257, 7)
    assert "draft_vocab_size" not in plan.config and plan.config["vocab_size"] == 49152
    w2 = loaded.params["markov_head.markov_w2.weight"]  # (V, 257) bf16
    assert w2.shape == (49152, 257) and int((w2[:, -1] == OUTSIDE_BIAS).sum()) == 49152 - 8192
    assert torch.all(loaded.params["markov_head.markov_w1.weight"][:, -1] == 1)
    assert "--speculative-num-draft-tokens 8" in command
