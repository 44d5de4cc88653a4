"""Loss terms (dspark.drafters.losses) against hand computations on tiny tensors (eqs. 8-12)."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.drafters.losses import (
    DEN_EPS,
    chunked_row_terms,
    chunked_soft_cross_entropy,
    confidence_bce,
    position_weights,
    row_terms,
    soft_acceptance,
    soft_cross_entropy,
    tau_estimate,
    weighted_mean,
)
from dspark.drafters.eagle3.loss import eagle3_step_weight


def test_position_weights_exp_decay_times_eval_mask():
    eval_mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    w = position_weights(eval_mask, 4.0)
    e = [math.exp(-k / 4.0) for k in range(4)]
    assert torch.allclose(w, torch.tensor([[e[0], e[1], e[2], 0.0], [e[0], 0.0, 0.0, 0.0]]))
    assert torch.equal(position_weights(eval_mask, None), eval_mask.float())
    assert torch.equal(position_weights(eval_mask, 0.0), eval_mask.float())


def test_soft_acceptance_is_sum_of_minimum():
    draft = torch.tensor([[0.5, 0.3, 0.2, 0.0], [1.0, 0.0, 0.0, 0.0]])
    target = torch.tensor([[0.1, 0.3, 0.4, 0.2], [0.0, 1.0, 0.0, 0.0]])
    acc = soft_acceptance(draft, target)
    assert torch.allclose(acc, torch.minimum(draft, target).sum(-1))
    assert torch.allclose(acc, torch.tensor([0.1 + 0.3 + 0.2, 0.0]))


def test_row_terms_by_hand():
    draft_logits = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    target_logits = torch.tensor([[0.0, 1.0, 1.0], [3.0, 0.0, -1.0]])
    labels = torch.tensor([1, 2])
    ce, l1 = row_terms(draft_logits, target_logits, labels)
    for r in range(2):
        pd = [math.exp(x) for x in draft_logits[r].tolist()]
        pd = [x / sum(pd) for x in pd]
        pt = [math.exp(x) for x in target_logits[r].tolist()]
        pt = [x / sum(pt) for x in pt]
        assert ce[r].item() == pytest.approx(-math.log(pd[labels[r]]), rel=1e-6)  # eq. (9)
        assert l1[r].item() == pytest.approx(sum(abs(a - b) for a, b in zip(pd, pt)), rel=1e-6)  # eq. (10)


def test_confidence_bce_soft_label_by_hand():
    logits = torch.tensor([0.3, -1.2, 2.0])
    label = torch.tensor([0.7, 0.1, 1.0])
    got = confidence_bce(logits, label)
    for i in range(3):
        c = 1 / (1 + math.exp(-logits[i].item()))
        y = label[i].item()
        assert got[i].item() == pytest.approx(-(y * math.log(c) + (1 - y) * math.log(1 - c)), rel=1e-6)  # eq. (11)


def test_confidence_bce_does_not_backprop_into_the_label():
    logits = torch.zeros(2, requires_grad=True)
    label = torch.tensor([0.2, 0.9], requires_grad=True)
    confidence_bce(logits, label).sum().backward()
    assert label.grad is None and logits.grad is not None


def test_weighted_mean():
    term = torch.tensor([1.0, 2.0, 4.0])
    w = torch.tensor([1.0, 0.5, 0.0])
    assert weighted_mean(term, w).item() == pytest.approx((1.0 + 1.0) / (1.5 + DEN_EPS))


def test_soft_cross_entropy_by_hand():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    target = torch.tensor([[0.2, 0.3, 0.5]])
    ce, acc = soft_cross_entropy(logits, target)
    z = sum(math.exp(x) for x in (0.0, 1.0, 2.0))
    pd = [math.exp(x) / z for x in (0.0, 1.0, 2.0)]
    assert ce.item() == pytest.approx(-sum(t * math.log(p) for t, p in zip((0.2, 0.3, 0.5), pd)), rel=1e-6)
    assert acc.item() == pytest.approx(sum(min(t, p) for t, p in zip((0.2, 0.3, 0.5), pd)), rel=1e-6)


def test_eagle3_step_weights_decay():
    assert [eagle3_step_weight(s, 0.8) for s in range(3)] == pytest.approx([1.0, 0.8, 0.64])


def test_tau_estimate():
    acc = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.2, 0.9]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # block 0: 1 + 0.5 + 0.25; block 1: 1 + 1 + 0.2 + 0.18
    assert tau_estimate(acc, mask) == pytest.approx(((1.75) + (2.38)) / 2)
    assert math.isnan(tau_estimate(acc, torch.zeros_like(mask)))


def _fn_pair():
    torch.manual_seed(0)
    w_draft = torch.randn(7, 4, requires_grad=True)  # V=7, H=4
    w_bias = torch.randn(7, 2, requires_grad=True)  # r=2
    w_target = torch.randn(7, 4)

    def draft_fn(h, u):
        return h @ w_draft.T + u @ w_bias.T

    return draft_fn, (lambda h: h @ w_target.T), (w_draft, w_bias)


def test_chunked_row_terms_match_unchunked_values_and_gradients():
    draft_fn, target_fn, params = _fn_pair()
    h = torch.randn(9, 4)
    u = torch.randn(9, 2)
    th = torch.randn(9, 4)
    labels = torch.randint(0, 7, (9,))
    weights = torch.rand(9)

    ce_ref, l1_ref = row_terms(draft_fn(h, u), target_fn(th), labels)
    (weighted_mean(ce_ref, weights) + weighted_mean(l1_ref, weights)).backward()
    grads_ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    ce, l1 = chunked_row_terms(draft_fn, target_fn, (h, u), th, labels, chunk=4)  # 3 chunks, checkpointed
    (weighted_mean(ce, weights) + weighted_mean(l1, weights)).backward()
    assert torch.allclose(ce, ce_ref, atol=1e-6) and torch.allclose(l1, l1_ref, atol=1e-6)
    for p, g in zip(params, grads_ref):
        assert torch.allclose(p.grad, g, atol=1e-6)


def test_chunked_soft_cross_entropy_matches_unchunked():
    torch.manual_seed(1)
    w = torch.randn(6, 3)
    h, th = torch.randn(5, 3), torch.randn(5, 3)
    ce_ref, acc_ref = soft_cross_entropy(h @ w.T, torch.softmax(th @ w.T, -1))
    ce, acc = chunked_soft_cross_entropy(lambda x: x @ w.T, lambda x: x @ w.T, h, th, chunk=2)
    assert torch.allclose(ce, ce_ref, atol=1e-6) and torch.allclose(acc, acc_ref, atol=1e-6)
