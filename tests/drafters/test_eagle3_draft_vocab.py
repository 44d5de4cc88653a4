"""Eagle3 with a draft vocabulary (docs/training.md §Draft vocabulary), EAGLE-3's reduced LM head: the restricted
logits, the loss against the target's full distribution restricted to the W tokens, checkpoints that carry the
vocabulary and refuse another target, lossless decoding over the W tokens, and the engines' d2t export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.drafters.base import NoDrafter
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.eagle3.drafter import Eagle3Drafter
from dspark.drafters.eagle3.loss import Eagle3Loss
from dspark.drafters.eagle3.model import Eagle3Model
from dspark.drafters.registry import load_drafter
from dspark.errors import DSparkError, IncompatibleModelsError
from dspark.export.engines import export_for_engine, plan_export
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.training.config import TrainConfig, TrainConfigError
from tests.export import engine_loaders as engines
from tests.tiny import tiny_target

from .tiny_drafters import LAYER_IDS, random_tokens, request_after, sample_for, sharpen
from .tiny_drafters import tiny_eagle3 as tiny_full_eagle3

VOCAB = list(range(40, 96)) + list(range(2, 20))  # 74 of the tiny target's 96 tokens, not sorted


def tiny_eagle3(target, draft_vocab=None) -> Eagle3Model:
    """tiny_drafters.tiny_eagle3 (the same seed: the same layer and fc), with a draft vocabulary."""
    if draft_vocab is None:
        return tiny_full_eagle3(target)
    cfg = Eagle3Config(ttt_length=3, block_size=3, target_layer_ids=LAYER_IDS)
    return sharpen(Eagle3Model.from_target(target, cfg, torch.Generator().manual_seed(0), draft_vocab))


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def _sample(tiny, seed=6):
    return sample_for(tiny, random_tokens(14, seed=seed), LAYER_IDS, [0] * 4 + [1] * 10)


def test_restricted_logits_are_the_full_models_on_the_draft_tokens(tiny):
    full, small = tiny_eagle3(tiny), tiny_eagle3(tiny, VOCAB)
    assert small.draft_size == len(VOCAB) and small.lm_head.weight.shape == (len(VOCAB), tiny.hidden_size)
    torch.testing.assert_close(small.lm_head.weight, tiny.model.lm_head.weight[VOCAB])
    s = _sample(tiny)
    for h_full, h_small in zip(full.ttt_hidden_states(s), small.ttt_hidden_states(s)):
        torch.testing.assert_close(h_small, h_full)  # the same layer and fc: only the head differs
        torch.testing.assert_close(small.logits(h_small), full.logits(h_full)[:, VOCAB])
    assert small.draft_tokens(torch.tensor([0, 56])).tolist() == [40, 2]


def _hand_loss(target, model, sample, vocab, decay=0.8):
    """sum_s decay^s sum_i -sum_{w} p_t(vocab_w) log p_d(w) / L, p_t the target's full softmax (reference), and
    the acceptance sum_w min(p_d, p_t) of each step's rows."""
    L = sample.seq_len
    mask = sample.loss_mask.tolist()
    total, accs = 0.0, []
    for s, hidden in enumerate(model.ttt_hidden_states(sample)):
        step, acc = 0.0, []
        for i in range(L):
            if i + s >= L - 1 or not mask[i + s]:
                continue
            with torch.no_grad():
                p_t = torch.softmax(target.model.logits(sample.target_last_hidden[i + 1 + s]).float(), -1)[vocab]
            logp = torch.log_softmax(model.logits(hidden[i : i + 1])[0].float(), -1)
            step += -(p_t * logp).sum().item()
            acc.append(torch.minimum(p_t, logp.exp()).sum().item())
        total += decay**s * step / L
        accs.append(sum(acc) / len(acc))
    return total, accs


def test_loss_uses_the_full_vocabulary_target_distribution(tiny):
    model = tiny_eagle3(tiny, VOCAB)
    s = _sample(tiny)
    loss, metrics = Eagle3Loss(model.config)(model, model(s), s)
    expected, accs = _hand_loss(tiny, model, s, VOCAB)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    for k, a in enumerate(accs):
        assert metrics[f"acc@{k}"] == pytest.approx(a, abs=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in model.trainable_parameters()) and model.lm_head.weight.grad is None
    # negative control: a teacher renormalised on the draft vocabulary is another loss
    renorm = torch.logsumexp(model.target_logits(s.target_last_hidden).float(), -1)
    other = type(s)(s.input_ids, s.loss_mask, s.target_features, s.target_last_hidden, renorm)
    assert Eagle3Loss(model.config)(model, model(other), other)[0].item() > loss.item() * 1.01
    with pytest.raises(DSparkError, match="target_logsumexp"):
        bare = type(s)(s.input_ids, s.loss_mask, s.target_features, s.target_last_hidden, None)
        Eagle3Loss(model.config)(model, model(bare), bare)


def test_every_token_in_another_order_is_the_full_vocabulary_loss(tiny):
    """W = V (permuted): the restricted path computes the full-vocabulary loss and acceptances."""
    order = torch.randperm(96, generator=torch.Generator().manual_seed(3)).tolist()
    full, perm = tiny_eagle3(tiny), tiny_eagle3(tiny, order)
    s = _sample(tiny, seed=9)
    a, ma = Eagle3Loss(full.config)(full, full(s), s)
    b, mb = Eagle3Loss(perm.config)(perm, perm(s), s)
    assert b.item() == pytest.approx(a.item(), rel=1e-5)
    for key in ("acc@0", "acc@1", "acc@2", "tau"):
        assert mb[key] == pytest.approx(ma[key], abs=1e-5)


def test_checkpoint_carries_the_vocabulary_and_refuses_another_target(tiny, tmp_path):
    model = tiny_eagle3(tiny, VOCAB)
    model.save_checkpoint(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["draft_vocab"].tolist() == VOCAB
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in state)  # frozen copies left out
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(VOCAB) and len(cfg["target_fingerprint"]) == 64
    back = Eagle3Model.from_checkpoint(tmp_path, tiny)
    assert back.draft_vocab.tolist() == VOCAB
    torch.testing.assert_close(back.lm_head.weight, tiny.model.lm_head.weight[VOCAB])
    torch.testing.assert_close(back.fc.weight, model.fc.weight)
    with pytest.raises(IncompatibleModelsError, match="another target"):
        Eagle3Model.from_checkpoint(tmp_path, tiny_target(seed=1))


def test_decoding_drafts_only_the_vocabulary_and_stays_lossless(tiny, tmp_path):
    tiny_eagle3(tiny, VOCAB).save_checkpoint(tmp_path)
    drafter = load_drafter(str(tmp_path), tiny)
    assert isinstance(drafter, Eagle3Drafter) and drafter.draft_vocab.tolist() == VOCAB
    prompts = [random_tokens(6, seed=4), random_tokens(9, seed=5)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain = SpeculativeGenerator(tiny, NoDrafter(tiny.vocab_size)).generate(prompts, greedy)
    spec = SpeculativeGenerator(tiny, drafter).generate(prompts, greedy)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    req = request_after(tiny, prompts[0], LAYER_IDS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    block = drafter.propose([req], [3])
    assert block.draft_probs.shape == (1, 3, len(VOCAB)) and block.vocab.tolist() == VOCAB
    assert set(block.tokens.flatten().tolist()) <= set(VOCAB)
    probs = block.probs_over_vocabulary([0], 3, 96)  # (1, 3, V)
    outside = [t for t in range(96) if t not in VOCAB]
    assert float(probs[..., outside].abs().max()) == 0.0
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 3))
    for k in range(3):  # each token is drawn from the distribution the block reports
        assert float(probs[0, k, block.tokens[0, k]]) > 0


def test_training_config_takes_a_draft_vocabulary_for_eagle3():
    assert TrainConfig(drafter="eagle3", draft_vocab_size=8192).draft_vocab_size == 8192
    with pytest.raises(TrainConfigError, match="dspark, dflash, eagle3"):
        TrainConfig(drafter="draft-lm", draft_vocab_size=8192)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_writes_d2t_the_heads_rows_and_the_targets_embedding(tiny, tmp_path, engine):
    ckpt = tmp_path / "ckpt"
    tiny_eagle3(tiny, VOCAB).save_checkpoint(ckpt)
    with pytest.raises(IncompatibleModelsError, match="--target-folder"):  # the frozen head and embedding are out
        plan_export(ckpt, engine)
    (tmp_path / "target").mkdir()
    save_file({"lm_head.weight": tiny.model.lm_head.weight.detach().contiguous(),
               "model.embed_tokens.weight": tiny.model.model.embed_tokens.weight.detach().contiguous()},
              str(tmp_path / "target" / "model.safetensors"))
    plan, _ = export_for_engine(ckpt, engine, tmp_path / "out", target_folder=tmp_path / "target")
    assert any("d2t" in n for n in plan.notes)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    ids = torch.tensor(VOCAB)
    assert "draft_vocab" not in tensors and torch.equal(torch.arange(len(VOCAB)) + tensors["d2t"], ids)
    assert torch.equal(tensors["lm_head.weight"], tiny.model.lm_head.weight.detach()[ids].to(torch.bfloat16))
    assert torch.equal(tensors["embed_tokens.weight"], tiny.model.model.embed_tokens.weight.detach().to(torch.bfloat16))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(VOCAB) and cfg["vocab_size"] == 96
    if engine == "sglang":
        loaded = engines.sglang_eagle3(tmp_path / "out")
        assert (loaded.ignored, loaded.unfilled, loaded.draft_vocab_size) == ([], [], len(VOCAB))
        assert loaded.params["hot_token_id"].tolist() == VOCAB


def test_a_draft_vocab_file_restricts_a_full_checkpoint_in_memory(tiny, tmp_path):
    from dspark.drafters.draft_vocab import save_draft_vocab
    from dspark.drafters.options import DraftingOptions

    tiny_eagle3(tiny).save_checkpoint(tmp_path / "full")
    vocab_file = save_draft_vocab(tmp_path / "vocab.json", VOCAB, 96, 0.9, "test")
    drafter = load_drafter(str(tmp_path / "full"), tiny, DraftingOptions(draft_vocab=str(vocab_file)))
    assert drafter.draft_vocab.tolist() == VOCAB
    s = _sample(tiny)
    ref = tiny_eagle3(tiny, VOCAB)  # the same weights, built restricted
    for a, b in zip(drafter.model.ttt_hidden_states(s), ref.ttt_hidden_states(s)):
        torch.testing.assert_close(drafter.model.logits(a), ref.logits(b))
    tiny_eagle3(tiny, VOCAB[:30]).save_checkpoint(tmp_path / "small")
    with pytest.raises(IncompatibleModelsError, match="drop --draft-vocab"):  # it carries another vocabulary
        load_drafter(str(tmp_path / "small"), tiny, DraftingOptions(draft_vocab=str(vocab_file)))
