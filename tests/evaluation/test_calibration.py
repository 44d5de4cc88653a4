"""Sequential temperature scaling and confidence shards (the STS file: tests/scheduler/test_sts.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.evaluation.calibration import (
    default_temperature_grid,
    fit_sts,
    load_confidence_shards,
    save_confidence_shard,
)
from dspark.evaluation.metrics import confidence_report, survival_by_position
from dspark.evaluation.plots import plot_reliability
from dspark.scheduler.sts import apply_sts

K = 4


def simulate(n: int, inflate: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps whose draft k is accepted with true probability sigmoid(z_k) given drafts < k accepted.

    The confidence logits are ``inflate * z``: inflate > 1 is an over-confident head.
    Returns (conf_logits (N, K), proposed_mask (N, K), num_accepted (N,)).
    """
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 1.5, size=(n, K))  # (N, K) true conditional logits
    flags = rng.random((n, K)) < 1 / (1 + np.exp(-z))
    num_accepted = np.cumprod(flags, axis=1).sum(axis=1)
    return inflate * z, np.ones((n, K), dtype=bool), num_accepted


def test_default_grid_matches_sglang():
    grid = default_temperature_grid()
    assert len(grid) == 41 and grid[0] == pytest.approx(0.1) and grid[-1] == pytest.approx(10.0)
    assert grid[20] == pytest.approx(1.0)
    assert np.allclose(np.diff(np.log(grid)), np.log(10) / 20)


def test_sts_fixes_an_overconfident_head():
    logits, proposed, accepted = simulate(20_000, inflate=3.0)
    result = fit_sts(logits, proposed, accepted)
    assert result.num_samples == 20_000 and len(result.temperatures) == K
    # the true first-position temperature is 3; grid spacing is a factor 1.12
    assert 2.5 < result.temperatures[0] < 3.6
    assert all(after < 0.5 * before for before, after in zip(result.ece_before, result.ece_after))
    assert max(result.ece_after) < 0.03  # ~N^-1/2 noise per bin, bins of >= hundreds of rows
    # the reported ECEs are the ones confidence_report measures with those temperatures
    report = confidence_report(logits, proposed, accepted, temperatures=result.temperatures)
    assert [p["ece"] for p in report["per_position"]] == pytest.approx(result.ece_after)


def test_sts_leaves_a_calibrated_head_alone():
    """Negative control: with inflate = 1 the fitted temperatures stay near 1."""
    logits, proposed, accepted = simulate(20_000, inflate=1.0, seed=1)
    result = fit_sts(logits, proposed, accepted)
    assert all(0.7 < t < 1.45 for t in result.temperatures)
    assert max(result.ece_before) < 0.03
    assert result.ece_after[0] <= result.ece_before[0]  # T = 1 is on the grid


def test_sts_preserves_order_at_each_position():
    logits, proposed, accepted = simulate(2_000, inflate=3.0, seed=2)
    result = fit_sts(logits, proposed, accepted, grid=[0.5, 2.0, 4.0], n_bins=15)
    assert set(result.temperatures) <= {0.5, 2.0, 4.0}
    calibrated = apply_sts(logits, result.temperatures)
    for k in range(K):
        assert np.array_equal(np.argsort(logits[:, k], kind="stable"), np.argsort(calibrated[:, k], kind="stable"))


def test_sts_only_scores_verified_rows():
    logits, proposed, accepted = simulate(4_000, inflate=3.0, seed=3)
    proposed[:2_000, 2:] = False  # half the steps stopped after 2 drafts...
    accepted = np.minimum(accepted, np.where(proposed.all(axis=1), K, 2))
    result = fit_sts(logits, proposed, accepted)
    survival = survival_by_position(logits, proposed, accepted)
    assert len(survival[3][0]) == 2_000
    with pytest.raises(ValueError, match="never verified"):
        fit_sts(logits[:2_000], proposed[:2_000], accepted[:2_000])
    assert result.ece_after[3] < result.ece_before[3]
    with pytest.raises(ValueError, match="not proposed"):
        fit_sts(logits, proposed, np.full(4_000, K))


# --------------------------------------------------------------------------- shards


def test_confidence_shards_round_trip(tmp_path):
    logits, proposed, accepted = (torch.as_tensor(x) for x in simulate(10, inflate=1.0))
    proposed[0, 3] = False
    accepted[0] = min(int(accepted[0]), 3)
    save_confidence_shard(tmp_path / "a.0.pt", logits[:6], proposed[:6], accepted[:6])
    save_confidence_shard(tmp_path / "a.1.pt", logits[6:], proposed[6:], accepted[6:])
    data = load_confidence_shards([tmp_path / "a.0.pt", tmp_path / "a.1.pt"])
    assert torch.equal(data.logits, logits.float())
    assert torch.equal(data.proposed_mask, proposed) and torch.equal(data.num_accepted, accepted)
    # the SGLang key means "drafts 0..k accepted", so SGLang's fitter can read our shards
    shard = torch.load(tmp_path / "a.0.pt", weights_only=True)
    assert torch.equal(shard["prefix_mask"].sum(dim=1).long(), accepted[:6])


def test_sglang_shards_load_as_all_verified(tmp_path):
    prefix_mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.save({"logits": torch.randn(2, 3), "prefix_mask": prefix_mask}, tmp_path / "sg.0.pt")
    data = load_confidence_shards([tmp_path / "sg.0.pt"])
    assert data.num_accepted.tolist() == [2, 0] and bool(data.proposed_mask.all())


def test_shard_errors(tmp_path):
    with pytest.raises(ValueError, match="no confidence shards"):
        load_confidence_shards([])
    with pytest.raises(ValueError, match="exceeds"):
        save_confidence_shard(tmp_path / "x.pt", torch.zeros(1, 2), torch.tensor([[True, False]]), torch.tensor([2]))
    save_confidence_shard(tmp_path / "k2.pt", torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.tensor([1]))
    save_confidence_shard(tmp_path / "k3.pt", torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), torch.tensor([1]))
    with pytest.raises(ValueError, match="K=3"):
        load_confidence_shards([tmp_path / "k2.pt", tmp_path / "k3.pt"])


def test_reliability_plot_before_and_after_sts(tmp_path):
    logits, proposed, accepted = simulate(2_000, inflate=3.0, seed=4)
    result = fit_sts(logits, proposed, accepted)
    before = survival_by_position(logits, proposed, accepted)
    after = survival_by_position(logits, proposed, accepted, result.temperatures)
    path = plot_reliability(
        [label for _, label in before],
        {"before STS": [p for p, _ in before], "after STS": [p for p, _ in after]},
        tmp_path / "fig6.png",
    )
    assert path.read_bytes()[:4] == b"\x89PNG"
