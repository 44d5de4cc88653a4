"""Slot conventions and head types at load time (docs/interop.md §Slot conventions): an anchor + k checkpoint
is converted (decoding reads slots 1..G-1) or refused, never read one position off; head tensors must match
config.json's head settings; the gated head saves and loads."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.drafters.dspark.blocks import build_blocks
from dspark.drafters.dspark.config import slot_offset_of
from dspark.drafters.dspark.loss import DSparkLoss
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel
from dspark.errors import ModelLoadError
from dspark.sampling.processing import SamplingParams
from tests.tiny import tiny_target

from .tiny_drafters import LAYER_IDS, random_tokens, request_after, sample_for, tiny_dflash, tiny_dspark


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def _rewrite(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_slot_offset_of_names_the_conventions():
    assert slot_offset_of({"architectures": ["Qwen3DSparkModel"]}) == 0  # DeepSpec: slot k -> anchor + k + 1
    assert slot_offset_of({"architectures": ["DSparkDraftModel"]}) == 0
    assert slot_offset_of({"architectures": ["DFlashDraftModel"]}) == 1  # z-lab / SpecForge DFlash
    assert slot_offset_of({"architectures": ["Qwen3DSparkModel"], "speculators_model_type": "dspark"}) == 1


@pytest.mark.parametrize("make", [tiny_dflash, tiny_dspark])
def test_anchor_plus_k_checkpoint_drafts_from_slots_1_on(tiny, tmp_path, make):
    """Converted: draft k comes from slot k + 1 of the same block; the negative control (the same weights read
    as DeepSpec's convention) drafts from slot k, a different distribution."""
    model = make(tiny)
    model.save_checkpoint(tmp_path / "deepspec")
    model.save_checkpoint(tmp_path / "zlab")
    _rewrite(tmp_path / "zlab", architectures=["DFlashDraftModel"])
    ours = DSparkModel.from_checkpoint(tmp_path / "deepspec", tiny)
    theirs = DSparkModel.from_checkpoint(tmp_path / "zlab", tiny)
    G = ours.config.block_size
    assert theirs.config.slot_offset == 1 and theirs.config.num_drafts == G - 1
    drafter = DSparkDrafter(theirs)
    assert drafter.block_size == G - 1
    prompt = random_tokens(9, seed=3)
    req = request_after(tiny, prompt, LAYER_IDS, SamplingParams(temperature=1.0, seed=1))
    block = drafter.propose([req], [G])  # asks for G, gets at most G - 1
    assert block.tokens.shape[1] == G - 1
    drafts = block.tokens[0].tolist()
    # teacher-forced reference: the same block (anchor, masks), every slot's distribution
    sample = sample_for(tiny, prompt + drafts + [0], LAYER_IDS)
    out = ours.block_outputs(sample, torch.tensor([len(prompt) - 1]))
    prev = torch.tensor([[prompt[-1], *drafts]])  # x_{k-1} of draft k = the token before it
    latent = None
    if ours.markov_head is not None:
        latent = ours.markov_head.latents(out.hidden[:, 1:], prev[:, : G - 1])
    probs = torch.softmax(ours.draft_logits(out.hidden[:, 1:], latent)[0], dim=-1)  # slots 1..G-1
    assert torch.allclose(probs, block.draft_probs[0], atol=1e-5)
    wrong = torch.softmax(ours.base_logits(out.hidden[0, : G - 1]), dim=-1)  # slots 0..G-2: the silent mistake
    assert not torch.allclose(wrong, block.draft_probs[0], atol=1e-2)


def test_anchor_plus_k_blocks_supervise_slot_k_with_anchor_plus_k():
    """slot_offset 1: slot k's label is the token at anchor + k, scored against the target's state at
    anchor + k - 1; slot 0 is never supervised. The same call with slot_offset 0 is DeepSpec's (anchor + k + 1)."""
    ids = torch.arange(100, 120)
    mask = torch.ones(20, dtype=torch.long)
    anchors = torch.tensor([3, 10])
    ours = build_blocks(ids, mask, anchors, 4, 99, slot_offset=1)
    deepspec = build_blocks(ids, mask, anchors, 4, 99)
    assert ours.labels[:, 1:].tolist() == [[104, 105, 106], [111, 112, 113]]
    assert deepspec.labels[:, :3].tolist() == [[104, 105, 106], [111, 112, 113]]  # one slot earlier
    assert ours.eval_mask[:, 0].tolist() == [False, False] and ours.eval_mask[:, 1:].all()
    assert ours.target_index[:, 1:].tolist() == [[3, 4, 5], [10, 11, 12]]
    assert ours.prev_tokens[:, 1].tolist() == [103, 110]  # draft 0's previous token is the anchor
    assert torch.equal(ours.block_ids, deepspec.block_ids) and torch.equal(ours.positions, deepspec.positions)
    end = build_blocks(ids, mask, torch.tensor([17]), 4, 99, slot_offset=1)  # labels run past the sequence
    assert end.eval_mask[0].tolist() == [False, True, True, False]


@pytest.mark.parametrize("make", [tiny_dflash, tiny_dspark])
def test_anchor_plus_k_drafter_trains_and_saves_as_dflash_draft_model(tiny, tmp_path, make):
    model = make(tiny, slot_offset=1)
    sample = sample_for(tiny, random_tokens(16, seed=4), LAYER_IDS)
    outputs = model(sample, torch.Generator().manual_seed(0))
    loss, metrics = DSparkLoss(model.config)(model, outputs, sample)
    loss.backward()
    assert torch.isfinite(loss) and "acc@0" in metrics and f"acc@{model.config.block_size - 1}" not in metrics
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.trainable_parameters())
    model.save_checkpoint(tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["slot_offset"] == 1
    back = DSparkModel.from_checkpoint(tmp_path / "c", tiny)
    assert back.config.slot_offset == 1
    anchors = torch.tensor([2, 7])
    assert torch.allclose(model.block_logits(sample, anchors), back.block_logits(sample, anchors), atol=1e-5)


def test_gated_head_checkpoint_round_trips_in_deepspec_layout(tiny, tmp_path):
    model = tiny_dspark(tiny, markov_head_type="gated")
    r, H = model.config.markov_rank, model.spec.hidden_size
    assert model.markov_head.gate_proj.weight.shape == (r, H + r)  # DeepSpec: Linear(hidden + rank, rank)
    model.save_checkpoint(tmp_path / "g")
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg["markov_head_type"] == "gated"
    back = DSparkModel.from_checkpoint(tmp_path / "g", tiny)
    sample = sample_for(tiny, random_tokens(14, seed=2), LAYER_IDS)
    anchors = torch.tensor([2, 6])
    assert torch.allclose(model.block_logits(sample, anchors), back.block_logits(sample, anchors), atol=1e-5)


@pytest.mark.parametrize("saved,claimed", [("gated", "vanilla"), ("rnn", "vanilla"), ("rnn", "gated")])
def test_head_tensors_that_config_does_not_build_are_refused(tiny, tmp_path, saved, claimed):
    tiny_dspark(tiny, markov_head_type=saved).save_checkpoint(tmp_path / "h")
    _rewrite(tmp_path / "h", markov_head_type=claimed)
    with pytest.raises(ModelLoadError):
        DSparkModel.from_checkpoint(tmp_path / "h", tiny)


def test_unknown_head_type_is_refused(tiny, tmp_path):
    tiny_dspark(tiny).save_checkpoint(tmp_path / "u")
    _rewrite(tmp_path / "u", markov_head_type="lstm")
    with pytest.raises(ModelLoadError, match="markov_head_type"):
        DSparkModel.from_checkpoint(tmp_path / "u", tiny)
