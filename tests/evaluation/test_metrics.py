"""Confidence metrics and the plot functions (acceptance statistics: tests/generation/test_stats.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dspark.evaluation import plots
from dspark.evaluation.metrics import (
    auroc,
    brier,
    confidence_report,
    ece,
    prefix_labels,
    reliability_bins,
    survival_by_position,
)


# --------------------------------------------------------------------------- confidence metrics


def test_ece_by_hand():
    pred, label = [0.1, 0.2, 0.8, 0.9], [0, 1, 1, 1]
    # 2 bins: [0, .5) holds .1, .2 (mean .15, labels .5); [.5, 1] holds .8, .9 (mean .85, labels 1)
    assert ece(pred, label, n_bins=2) == pytest.approx(0.5 * 0.35 + 0.5 * 0.15)
    # 20 bins: every point alone in its bin -> mean |pred - label|
    assert ece(pred, label) == pytest.approx((0.1 + 0.8 + 0.2 + 0.1) / 4)
    assert ece(np.array([1.0, 0.0]), np.array([1, 0])) == 0.0  # 1.0 lands in the last bin
    assert math.isnan(ece([], []))
    bins = reliability_bins(pred, label, n_bins=2)
    assert bins.count.tolist() == [2, 2] and bins.label_mean.tolist() == [0.5, 1.0]


def test_auroc_by_hand_with_ties():
    # positives {.5, .9}, negatives {.1, .5}: pairs 1 + 1/2 (tie) + 1 + 1 = 3.5 of 4
    assert auroc([0.1, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(3.5 / 4)
    assert auroc([0.3, 0.3, 0.3], [1, 0, 1]) == pytest.approx(0.5)
    assert auroc([0.2, 0.8], [0, 1]) == 1.0 and auroc([0.2, 0.8], [1, 0]) == 0.0
    assert math.isnan(auroc([0.2, 0.8], [1, 1]))
    with pytest.raises(ValueError, match="binary"):
        auroc([0.2, 0.8], [0.5, 1])


def test_auroc_matches_pairwise_count():
    rng = np.random.default_rng(1)
    pred = rng.integers(0, 6, size=60) / 5.0  # many ties
    label = (rng.random(60) < 0.4).astype(int)
    pos, neg = pred[label == 1], pred[label == 0]
    pairs = [1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg)]
    assert auroc(torch.tensor(pred), torch.tensor(label)) == pytest.approx(np.mean(pairs))


def test_brier_by_hand():
    assert brier([0.1, 0.2, 0.8, 0.9], [0, 1, 1, 1]) == pytest.approx((0.01 + 0.64 + 0.04 + 0.01) / 4)


def test_prefix_labels_from_counts_and_flags():
    from_counts = prefix_labels(np.array([0, 2, 3]), 3)
    from_flags = prefix_labels(np.array([[0, 1, 1], [1, 1, 0], [1, 1, 1]]), 3)
    expected = [[False, False, False], [True, True, False], [True, True, True]]
    assert from_counts.tolist() == expected and from_flags.tolist() == expected


def test_confidence_report_by_hand():
    # logit 0 -> sigmoid 1/2, so survival is 1/2 at position 0 and 1/4 at position 1.
    logits = torch.zeros(3, 2)
    proposed = torch.tensor([[True, True], [True, True], [True, False]])
    num_accepted = torch.tensor([2, 0, 1])
    report = confidence_report(logits, proposed, num_accepted)
    pos0, pos1 = report["per_position"]
    assert pos0["count"] == 3 and pos1["count"] == 2  # row 2 never verified draft 1
    assert pos0["pred_mean"] == pytest.approx(0.5) and pos0["target_mean"] == pytest.approx(2 / 3)
    assert pos1["pred_mean"] == pytest.approx(0.25) and pos1["target_mean"] == pytest.approx(0.5)
    assert pos0["ece"] == pytest.approx(1 / 6) and pos1["ece"] == pytest.approx(0.25)
    assert pos0["brier"] == pytest.approx(0.25) and pos1["brier"] == pytest.approx((0.75**2 + 0.25**2) / 2)
    assert pos0["auroc"] == pytest.approx(0.5)  # all predictions tied
    assert report["count"] == 5
    assert report["ece_mean"] == pytest.approx((3 * (1 / 6) + 2 * 0.25) / 5)
    assert report["target_mean"] == pytest.approx((3 * (2 / 3) + 2 * 0.5) / 5)
    # per-draft flags give the same labels as counts
    flags = torch.tensor([[1, 1], [0, 1], [1, 0]])
    assert confidence_report(logits, proposed, flags) == report
    # temperatures divide the logits before the sigmoid
    logits2 = torch.full((3, 2), 2.0)
    cooled = survival_by_position(logits2, proposed, num_accepted, temperatures=[2.0, 2.0])
    assert cooled[0][0] == pytest.approx(np.full(3, 1 / (1 + math.exp(-1))))


def test_confidence_report_rejects_bad_inputs():
    logits = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="not proposed"):
        confidence_report(logits, torch.tensor([[True, False], [True, True]]), torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="temperatures"):
        confidence_report(logits, torch.ones(2, 2, dtype=torch.bool), torch.tensor([1, 0]), [1.0])
    with pytest.raises(ValueError, match="proposed_mask"):
        confidence_report(logits, torch.ones(2, 3, dtype=torch.bool), torch.tensor([1, 0]))


# --------------------------------------------------------------------------- plots


def test_plots_write_pngs(tmp_path):
    written = [
        plots.plot_acceptance_curves({"math": [0.9, 0.8, None], "code": [0.8, 0.7, 0.6]}, tmp_path / "fig2.png"),
        plots.plot_threshold_sweep(
            [
                {"domain": d, "threshold": t, "verified_per_step": 6 - 5 * t, "accepted_per_step": 4 - 3 * t}
                for d in ("math", "chat")
                for t in (0.0, 0.3, 0.6)
            ],
            tmp_path / "fig5.png",
        ),
        plots.plot_throughput_vs_user_speed(
            [
                {"policy": p, "concurrency": c, "user_tokens_per_s": 100 / c, "total_tokens_per_s": 90 * c**0.8}
                for p in ("static", "dspark")
                for c in (1, 4, 16)
            ],
            tmp_path / "sub" / "fig7.png",
        ),
        plots.plot_verify_budget(
            [{"policy": p, "concurrency": c, "avg_verify_len": 8 / c**0.3} for p in ("a", "b") for c in (1, 8, 64)],
            tmp_path / "fig8.png",
        ),
    ]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

