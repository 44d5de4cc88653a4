"""DSpark / DFlash with a draft vocabulary inside the model and the checkpoint (docs/training.md §Draft vocabulary):
restricted heads, the losses on the full-vocabulary target distribution, checkpoints without a side file,
lossless decoding, and the errors for a vocabulary or checkpoint that does not fit the target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.drafters.base import NoDrafter
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.loss import DSparkLoss
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.dspark.vocab import prune_to_draft_vocab, restrict_to_draft_vocab
from dspark.drafters.losses import position_weights, weighted_mean
from dspark.drafters.registry import load_drafter
from dspark.drafters.options import DraftingOptions
from dspark.errors import DSparkError, IncompatibleModelsError, ModelLoadError
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from tests.tiny import tiny_target

from dspark.drafters.dspark.config import DSparkConfig

from .tiny_drafters import LAYER_IDS, random_tokens, sample_for, sharpen
from .tiny_drafters import tiny_dspark as tiny_full_dspark

VOCAB = list(range(40, 96)) + list(range(2, 20))  # 74 of the tiny target's 96 tokens, not sorted


def tiny_dspark(target, draft_vocab=None, **overrides) -> DSparkModel:
    """tiny_drafters.tiny_dspark, with a draft vocabulary."""
    if draft_vocab is None:
        return tiny_full_dspark(target, **overrides)
    kw = dict(block_size=4, markov_rank=8, num_anchors=6, target_layer_ids=LAYER_IDS, **overrides)
    return sharpen(DSparkModel.from_target(target, DSparkConfig(**kw), torch.Generator().manual_seed(0), draft_vocab))


def tiny_dflash(target, draft_vocab=None) -> DSparkModel:
    cfg = DSparkConfig.dflash(block_size=4, num_anchors=6, target_layer_ids=LAYER_IDS)
    return sharpen(DSparkModel.from_target(target, cfg, torch.Generator().manual_seed(0), draft_vocab))


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def test_restricted_logits_are_the_full_models_on_the_draft_tokens(tiny):
    full = tiny_dspark(tiny)
    small = restrict_to_draft_vocab(full, VOCAB)
    assert small.draft_size == len(VOCAB) and small.lm_head.weight.shape == (len(VOCAB), 32)
    assert small.markov_head.markov_w1.weight.shape[0] == small.markov_head.markov_w2.weight.shape[0] == len(VOCAB)
    s = sample_for(tiny, random_tokens(40, seed=1), LAYER_IDS)
    anchors = torch.tensor([3, 11, 20, 30])
    out = small.block_outputs(s, anchors)
    inside = small.draft_index(out.blocks.prev_tokens) >= 0  # (A, G)
    assert inside.any() and (~inside).any()  # both cases occur
    a, b = full.block_logits(s, anchors)[..., VOCAB], small.block_logits(s, anchors)
    torch.testing.assert_close(b[inside], a[inside], rtol=0, atol=0)
    # a previous token outside the draft vocabulary has a zero Markov embedding: B_k = 0
    torch.testing.assert_close(b[~inside], full.base_logits(out.hidden)[..., VOCAB][~inside])
    assert not torch.allclose(b[~inside], a[~inside])  # negative control: the full model's W1 row is not zero


def _hand_loss(model, sample, outputs, vocab):
    """Eq. (12) over the full vocabulary, the draft distribution 0 outside ``vocab`` (reference)."""
    cfg, blocks = model.config, outputs.blocks
    rows = blocks.eval_mask.flatten().nonzero().squeeze(-1)
    w = position_weights(blocks.eval_mask, cfg.loss_decay_gamma).flatten()[rows]
    draft = torch.zeros(rows.numel(), 96)
    logits = model.draft_logits(outputs.hidden.reshape(-1, 32)[rows], outputs.latents.reshape(-1, 8)[rows])
    draft[:, vocab] = torch.softmax(logits.float(), -1)
    target_h = sample.target_last_hidden[blocks.target_index.flatten()[rows]]
    target = torch.softmax(tiny_target().model.logits(target_h).float(), -1)
    labels = blocks.labels.flatten()[rows]
    inside = torch.isin(labels, torch.tensor(vocab))
    ce = -torch.log(draft.gather(1, labels[:, None]).squeeze(1).clamp_min(1e-30))
    l1 = (draft - target).abs().sum(-1)
    soft = (1 - 0.5 * l1).clamp(0, 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(outputs.confidence_logits.flatten()[rows], soft,
                                                               reduction="none")
    return (cfg.ce_loss_alpha * weighted_mean(ce * inside, w * inside) + cfg.l1_loss_alpha * weighted_mean(l1, w)
            + cfg.confidence_head_alpha * weighted_mean(bce, w))


def test_loss_uses_the_full_vocabulary_target_distribution(tiny):
    """L1 and c* count the target's mass outside the draft vocabulary; CE skips labels outside."""
    model = tiny_dspark(tiny, draft_vocab=VOCAB)
    s = sample_for(tiny, random_tokens(48, seed=2), LAYER_IDS)
    outputs = model(s, torch.Generator().manual_seed(0))
    loss, metrics = DSparkLoss(model.config)(model, outputs, s)
    torch.testing.assert_close(loss, _hand_loss(model, s, outputs, VOCAB), rtol=1e-4, atol=1e-5)
    # negative control: renormalising the target on the draft vocabulary gives another loss
    renorm = s.target_logsumexp - torch.logsumexp(model.target_logits(s.target_last_hidden), -1) + 0.0
    s2 = type(s)(s.input_ids, s.loss_mask, s.target_features, s.target_last_hidden, s.target_logsumexp - renorm)
    other, _ = DSparkLoss(model.config)(model, outputs, s2)
    assert abs(float(other.detach()) - float(loss.detach())) > 1e-3
    loss.backward()
    assert model.markov_head.markov_w2.weight.grad.shape == (len(VOCAB), 8)
    # a sample without the target's log-sum-exp is refused, not silently renormalised
    with pytest.raises(DSparkError, match="target_logsumexp"):
        DSparkLoss(model.config)(model, outputs, type(s)(s.input_ids, s.loss_mask, s.target_features,
                                                         s.target_last_hidden))


def test_checkpoint_carries_the_vocabulary_without_frozen_weights(tiny, tmp_path):
    model = tiny_dspark(tiny, draft_vocab=VOCAB)
    model.save_checkpoint(tmp_path, torch.bfloat16)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["draft_vocab"].dtype == torch.int64 and state["draft_vocab"].tolist() == VOCAB
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in state)
    assert state["markov_head.markov_w1.weight"].shape == (len(VOCAB), 8)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(VOCAB) and len(cfg["target_fingerprint"]) == 64
    back = DSparkModel.from_checkpoint(tmp_path, tiny)
    assert back.draft_vocab.tolist() == VOCAB
    torch.testing.assert_close(back.lm_head.weight, tiny.model.lm_head.weight[VOCAB])
    with pytest.raises(ModelLoadError, match="missing"):  # without a target the frozen weights are missing
        DSparkModel.from_checkpoint(tmp_path)


@pytest.mark.parametrize("make", [tiny_dspark, tiny_dflash])
def test_decoding_needs_no_side_file_and_stays_lossless(tiny, tmp_path, make):
    make(tiny, draft_vocab=VOCAB).save_checkpoint(tmp_path)
    drafter = load_drafter(str(tmp_path), tiny)
    assert isinstance(drafter, DSparkDrafter) and drafter.draft_vocab.tolist() == VOCAB
    prompt = random_tokens(6, seed=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain = SpeculativeGenerator(tiny, NoDrafter(tiny.vocab_size)).generate([prompt], greedy)[0]
    assert SpeculativeGenerator(tiny, drafter).generate([prompt], greedy)[0].output_ids == plain.output_ids
    block = drafter.propose([_request(tiny, prompt)], [4])
    outside = [t for t in range(96) if t not in VOCAB]
    assert set(block.tokens.flatten().tolist()) <= set(VOCAB)
    probs = block.probs_over_vocabulary([0], 4, 96)  # (1, 4, V)
    assert float(probs[..., outside].abs().max()) == 0.0  # the distribution sampled from, in V
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4))


def _request(target, prompt):
    from .tiny_drafters import request_after

    return request_after(target, prompt, LAYER_IDS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))


def test_prune_matches_the_in_memory_restriction(tiny, tmp_path):
    full = tiny_dspark(tiny)
    full.save_checkpoint(tmp_path / "full")
    out = prune_to_draft_vocab(tmp_path / "full", VOCAB, tmp_path / "small", dtype=torch.float32)
    pruned = DSparkModel.from_checkpoint(out, tiny)
    s = sample_for(tiny, random_tokens(30, seed=5), LAYER_IDS)
    anchors = torch.tensor([4, 12, 20])
    ref = restrict_to_draft_vocab(full, VOCAB).block_logits(s, anchors)
    torch.testing.assert_close(pruned.block_logits(s, anchors), ref)
    # a --draft-vocab file on a full checkpoint restricts it the same way
    drafter = load_drafter(str(tmp_path / "full"), tiny, DraftingOptions(draft_vocab=_vocab_file(tmp_path, VOCAB)))
    assert drafter.draft_vocab.tolist() == VOCAB


def _vocab_file(tmp_path, ids, vocab_size=96):
    from dspark.drafters.draft_vocab import save_draft_vocab

    return str(save_draft_vocab(tmp_path / f"vocab{len(ids)}.json", ids, vocab_size, 0.9, "test"))


# --------------------------------------------------------------------------- bad input


def test_a_draft_vocabulary_that_does_not_fit_is_refused(tiny, tmp_path):
    with pytest.raises(IncompatibleModelsError, match="outside the target vocabulary of 96"):
        tiny_dspark(tiny, draft_vocab=[1, 2, 200])
    with pytest.raises(IncompatibleModelsError, match="repeat"):
        tiny_dspark(tiny, draft_vocab=[1, 2, 2])
    tiny_dspark(tiny, draft_vocab=VOCAB).save_checkpoint(tmp_path / "own")
    # a --draft-vocab file that differs from the checkpoint's own vocabulary
    with pytest.raises(IncompatibleModelsError, match="its own draft vocabulary"):
        load_drafter(str(tmp_path / "own"), tiny, DraftingOptions(draft_vocab=_vocab_file(tmp_path, [3, 4, 5])))
    # a file built for another vocabulary size
    with pytest.raises(DSparkError, match="96"):
        load_drafter(str(tmp_path / "own"), tiny, DraftingOptions(draft_vocab=_vocab_file(tmp_path, [3], 1000)))


def test_a_corrupt_draft_vocabulary_in_the_checkpoint_is_refused(tiny, tmp_path):
    tiny_dspark(tiny, draft_vocab=VOCAB).save_checkpoint(tmp_path)
    path, cfg_path = tmp_path / "model.safetensors", tmp_path / "config.json"
    state = load_file(str(path))
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "draft_vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="draft_vocab has 74 ids, config.json says draft_vocab_size 10"):
        DSparkModel.from_checkpoint(tmp_path, tiny)
    cfg_path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "draft_vocab_size"}))
    with pytest.raises(ModelLoadError, match="no draft_vocab_size"):
        DSparkModel.from_checkpoint(tmp_path, tiny)
    cfg_path.write_text(json.dumps(cfg))
    save_file({**state, "draft_vocab": torch.tensor(VOCAB[:-1] + [500])}, str(path))
    with pytest.raises(IncompatibleModelsError, match="outside the target vocabulary"):
        DSparkModel.from_checkpoint(tmp_path, tiny)
    save_file({k: v for k, v in state.items() if k != "draft_vocab"}, str(path))
    with pytest.raises(ModelLoadError, match="no draft_vocab tensor"):
        DSparkModel.from_checkpoint(tmp_path, tiny)


@pytest.mark.parametrize("vocab", [None, VOCAB])
def test_a_checkpoint_for_another_target_is_refused(tiny, tmp_path, vocab):
    """Same shapes, other weights (another target, or the same architecture with another tokenizer)."""
    tiny_dspark(tiny, draft_vocab=vocab).save_checkpoint(tmp_path, torch.bfloat16)
    DSparkModel.from_checkpoint(tmp_path, tiny)  # its own target (in fp32 while saved in bf16) loads
    with pytest.raises(IncompatibleModelsError, match="another target or tokenizer"):
        load_drafter(str(tmp_path), tiny_target(seed=7))
    # without the recorded fingerprint, a stored lm_head still tells (DeepSpec checkpoints)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "target_fingerprint": None}))
    if vocab is None:
        with pytest.raises(IncompatibleModelsError, match="another target or tokenizer"):
            load_drafter(str(tmp_path), tiny_target(seed=7))


def test_smollm2_checkpoint_with_an_8192_token_vocabulary_is_small(tmp_path):
    """The goal: a 1-layer SmolLM2 DSpark checkpoint, 8192-token draft vocabulary, bf16, <= 25 MiB."""
    from dspark.drafters.checkpoint import draft_spec_from
    from dspark.drafters.dspark.config import DSparkConfig
    from dspark.modeling.spec import spec_from_config
    from dspark.modeling.weights import read_config
    from dspark.target.convert import resolve_model_path

    try:
        folder = resolve_model_path("smollm2-135m")
    except DSparkError as err:
        pytest.skip(f"SmolLM2 unavailable: {err}")
    cfg = read_config(folder)
    spec = spec_from_config(cfg)
    dcfg = DSparkConfig(target_layer_ids=[1, 8, 15, 22, 28], mask_token_id=0)
    model = DSparkModel(dcfg, draft_spec_from(spec, 1), cfg, spec.num_layers, list(range(8192)))
    model.save_checkpoint(tmp_path, torch.bfloat16)
    assert (tmp_path / "model.safetensors").stat().st_size <= 25 * 2**20
