"""Sequential temperature scaling, the STS JSON file and confidence shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark.evaluation.calibration import (
    STSResult,
    apply_sts,
    default_temperature_grid,
    fit_sts,
    load_confidence_shards,
    load_sts_json,
    save_confidence_shard,
    save_sts_json,
)
from dspark.evaluation.metrics import confidence_report, survival_by_position
from dspark.evaluation.plots import plot_reliability

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


def test_apply_sts_on_tensors_and_arrays():
    logits = torch.tensor([[2.0, -2.0], [0.0, 4.0]])
    out = apply_sts(logits, [2.0, 4.0])
    assert isinstance(out, torch.Tensor)
    assert torch.allclose(out, torch.sigmoid(torch.tensor([[1.0, -0.5], [0.0, 1.0]])))
    assert np.allclose(apply_sts(logits.numpy(), [2.0, 4.0]), out.numpy())
    with pytest.raises(ValueError, match="temperatures"):
        apply_sts(logits, [1.0, 1.0, 1.0])


# --------------------------------------------------------------------------- STS JSON


def test_sts_json_round_trip_in_sglang_format(tmp_path):
    result = STSResult(temperatures=[1.5, 2.0, 0.5], ece_before=[0.1, 0.2, 0.3], ece_after=[0.01, 0.02, 0.03],
                       num_samples=123)
    path = tmp_path / "sts" / "dspark_sts.json"
    save_sts_json(path, result, dataset="gsm8k")
    payload = json.loads(path.read_text())
    assert list(payload) == ["temperatures", "dataset", "num_samples", "ece_before", "ece_after"]
    assert payload["dataset"] == "gsm8k" and payload["num_samples"] == 123
    assert load_sts_json(path, block_size=3) == [1.5, 2.0, 0.5]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"temperatures": [1.0, 2.0]}', "block size is 3"),
        ('{"temperatures": [1.0, 0.0, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, -1.0, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, NaN, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, true, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, "2", 2.0]}', "> 0"),
        ('{"temps": [1.0, 1.0, 1.0]}', "'temperatures' list"),
        ("[1.0, 1.0, 1.0]", "'temperatures' list"),
        ("{not json", "not valid JSON"),
    ],
)
def test_load_sts_json_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "sts.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_sts_json(path, block_size=3)


def test_load_sts_json_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_sts_json(tmp_path / "nope.json", block_size=3)


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
