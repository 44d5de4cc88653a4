"""Teacher-forced labelling in the losses (docs/training.md §Teacher-forced labelling): a supervised token with
loss_mask TARGET_LABEL (2) takes the target's argmax as its CE label (over the draft vocabulary's W tokens when
the drafter has one); L1 and the confidence BCE do not change; Eagle3 (soft targets only) is unaffected."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.drafters.draft_lm.loss import kl_row_terms
from dspark.drafters.dspark.loss import DSparkLoss
from dspark.drafters.eagle3.loss import Eagle3Loss
from dspark.drafters.losses import TARGET_LABEL, position_weights, row_terms, weighted_mean
from dspark.drafters.sample import TrainSample
from tests.tiny import tiny_target

from .test_dspark_draft_vocab import VOCAB
from .test_dspark_draft_vocab import tiny_dspark as tiny_dspark_vocab
from .tiny_drafters import LAYER_IDS, random_tokens, sample_for, tiny_dspark, tiny_eagle3


def _logp(row: list[float]) -> list[float]:
    z = math.log(sum(math.exp(x) for x in row))
    return [x - z for x in row]


def test_row_terms_by_hand_labelled_and_regenerated():
    draft_logits = torch.tensor([[1.0, 2.0, 0.0]])
    target_logits = torch.tensor([[0.0, 1.0, 3.0]])  # the target's argmax is token 2
    data = torch.tensor([1])  # the text's next token is 1
    ce_text, l1_text = row_terms(draft_logits, target_logits, data, from_target=torch.tensor([False]))
    ce_label, l1_label = row_terms(draft_logits, target_logits, data, from_target=torch.tensor([True]))
    logp = _logp([1.0, 2.0, 0.0])
    assert ce_text.item() == pytest.approx(-logp[1], rel=1e-6)  # mask 1: the data token
    assert ce_label.item() == pytest.approx(-logp[2], rel=1e-6)  # mask 2: -log p_draft(target argmax)
    assert torch.equal(l1_text, l1_label)  # eq. (10) already uses the target's distribution


def test_row_terms_by_hand_with_a_draft_vocabulary():
    """W = 3 of V = 4 tokens; the target's full-vocabulary argmax is the token outside W."""
    full_target = torch.tensor([[0.5, 2.0, 1.0, 5.0]])  # token 3 (outside W) is the full argmax
    target_w = full_target[:, :3]  # (1, W) the target's logits on the draft tokens
    lse = torch.logsumexp(full_target, -1)
    draft_logits = torch.tensor([[0.3, -1.0, 0.8]])
    outside = torch.tensor([-1])  # the text's next token is outside W: CE skips it
    ce_text, l1_text = row_terms(draft_logits, target_w, outside, lse, from_target=torch.tensor([False]))
    ce_label, l1_label = row_terms(draft_logits, target_w, outside, lse, from_target=torch.tensor([True]))
    assert ce_text.item() == 0.0
    assert ce_label.item() == pytest.approx(-_logp([0.3, -1.0, 0.8])[1], rel=1e-6)  # argmax restricted to W
    assert torch.equal(l1_text, l1_label)


def test_draft_lm_hard_label_is_the_target_argmax_on_labelled_rows():
    draft_logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    target_logits = torch.tensor([[0.0, 1.0, 3.0], [0.0, 1.0, 3.0]])
    kl, ce, _ = kl_row_terms(draft_logits, target_logits, torch.tensor([1, 1]), torch.tensor([False, True]))
    logp = _logp([1.0, 2.0, 0.0])
    assert ce.tolist() == pytest.approx([-logp[1], -logp[2]], rel=1e-6)
    assert kl[0].item() == pytest.approx(kl[1].item())


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def _with_mask(s: TrainSample, value: int) -> TrainSample:
    return TrainSample(s.input_ids, s.loss_mask * value, s.target_features, s.target_last_hidden, s.target_logsumexp)


def _hand_ce(model, target, sample, outputs, labels_from_target: bool, vocab=None) -> torch.Tensor:
    """CE of eq. (9) over the full vocabulary, the draft distribution 0 outside ``vocab`` (reference)."""
    blocks = outputs.blocks
    rows = blocks.eval_mask.flatten().nonzero().squeeze(-1)
    w = position_weights(blocks.eval_mask, model.config.loss_decay_gamma).flatten()[rows]
    latents = outputs.latents.reshape(-1, outputs.latents.shape[-1])[rows] if outputs.latents is not None else None
    logits = model.draft_logits(outputs.hidden.reshape(-1, 32)[rows], latents)
    vocab = list(range(96)) if vocab is None else vocab
    draft = torch.zeros(rows.numel(), 96)
    draft[:, vocab] = torch.softmax(logits.float(), -1)
    if labels_from_target:  # the target's argmax among the draft tokens, from its full-vocabulary logits
        full = target.model.logits(sample.target_last_hidden[blocks.target_index.flatten()[rows]]).float()
        labels = torch.tensor(vocab)[full[:, vocab].argmax(-1)]
    else:
        labels = blocks.labels.flatten()[rows]
    inside = torch.isin(labels, torch.tensor(vocab))
    ce = -torch.log(draft.gather(1, labels[:, None]).squeeze(1).clamp_min(1e-30))
    return weighted_mean(ce * inside, w * inside)


@pytest.mark.parametrize("vocab", [None, VOCAB], ids=["full-vocab", "draft-vocab"])
def test_dspark_loss_labelled_rows_train_on_the_target_argmax(tiny, vocab):
    model = tiny_dspark(tiny) if vocab is None else tiny_dspark_vocab(tiny, draft_vocab=vocab)
    s1 = sample_for(tiny, random_tokens(48, seed=2), LAYER_IDS)
    s2 = _with_mask(s1, TARGET_LABEL)
    out1, out2 = model(s1, torch.Generator().manual_seed(0)), model(s2, torch.Generator().manual_seed(0))
    assert torch.equal(out1.anchors, out2.anchors)  # value 2 is supervised like 1 for anchors and eval masks
    assert torch.equal(out1.blocks.eval_mask, out2.blocks.eval_mask)
    _, m1 = DSparkLoss(model.config)(model, out1, s1)
    _, m2 = DSparkLoss(model.config)(model, out2, s2)
    assert m1["ce"] == pytest.approx(float(_hand_ce(model, tiny, s1, out1, False, vocab).detach()), rel=1e-4)
    assert m2["ce"] == pytest.approx(float(_hand_ce(model, tiny, s2, out2, True, vocab).detach()), rel=1e-4)
    assert abs(m1["ce"] - m2["ce"]) > 1e-2  # negative control: random text is not the target's argmax
    assert m1["l1"] == pytest.approx(m2["l1"]) and m1["bce"] == pytest.approx(m2["bce"])


def test_mixed_sample_labels_each_row_by_its_own_mask(tiny):
    """Only rows whose predicted token has mask 2 switch label: with mask 1 on the first half and 2 on the
    second, the CE is the hand CE with the data token or the target's argmax chosen row by row."""
    model = tiny_dspark(tiny)
    s = sample_for(tiny, random_tokens(48, seed=3), LAYER_IDS)
    mask = s.loss_mask.clone()
    mask[24:] = TARGET_LABEL
    mixed = TrainSample(s.input_ids, mask, s.target_features, s.target_last_hidden, s.target_logsumexp)
    out = model(mixed, torch.Generator().manual_seed(1))
    _, metrics = DSparkLoss(model.config)(model, out, mixed)
    blocks = out.blocks
    rows = blocks.eval_mask.flatten().nonzero().squeeze(-1)
    w = position_weights(blocks.eval_mask, model.config.loss_decay_gamma).flatten()[rows]
    logp = torch.log_softmax(model.draft_logits(out.hidden.reshape(-1, 32)[rows],
                                                out.latents.reshape(-1, out.latents.shape[-1])[rows]).float(), -1)
    target_rows = blocks.target_index.flatten()[rows]
    argmax = tiny.model.logits(s.target_last_hidden[target_rows]).argmax(-1)
    labels = torch.where(target_rows + 1 >= 24, argmax, blocks.labels.flatten()[rows])
    assert (target_rows + 1 >= 24).any() and (target_rows + 1 < 24).any()  # both kinds of rows occur
    expected = weighted_mean(-logp.gather(1, labels[:, None]).squeeze(1), w)
    assert metrics["ce"] == pytest.approx(float(expected.detach()), rel=1e-4)


def test_eagle3_trains_on_the_soft_target_only(tiny):
    model = tiny_eagle3(tiny)
    s1 = sample_for(tiny, random_tokens(40, seed=4), LAYER_IDS)
    s2 = _with_mask(s1, TARGET_LABEL)
    loss1, _ = Eagle3Loss(model.config)(model, model(s1), s1)
    loss2, _ = Eagle3Loss(model.config)(model, model(s2), s2)
    assert float(loss1.detach()) == pytest.approx(float(loss2.detach()))
