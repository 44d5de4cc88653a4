"""Target features: online computation and the DeepSpec-format disk cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark.training.config import TrainConfig
from dspark.data.features import (
    INDEX_RECORD, FeatureCacheDataset, FeatureCacheError, build_feature_cache, bytes_per_token, check_cache_fits,
    compute_features,
)
from dspark.training.trainer import train
from tests.tiny import tiny_target

LAYERS = [0, 2, 3]


def token_data(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(2, 96, (n,), generator=g),
             "loss_mask": (torch.rand(n, generator=g) > 0.3).long()} for n in lengths]


def test_compute_features_matches_target_and_can_enter_autograd():
    target = tiny_target()
    ids = torch.randint(2, 96, (17,), generator=torch.Generator().manual_seed(1))
    features, last = compute_features(target, ids, LAYERS)
    assert features.shape == (17, 3 * 32) and last.shape == (17, 32)
    ref = target.forward(ids, [17], None, capture_layers=LAYERS, logits_for="none")
    torch.testing.assert_close(features, ref.features)
    torch.testing.assert_close(last, ref.last_hidden)
    w = torch.ones(3 * 32, requires_grad=True)
    (features * w).sum().backward()  # an inference-mode tensor here would raise
    assert w.grad is not None


def test_bytes_per_token_formula():
    assert bytes_per_token(576, 5) == 6 + 2 * 576 * 6 == 6918  # SmolLM2-135M, 5 layers
    assert bytes_per_token(2560, 5) == 30726  # Qwen3-4B, docs/interop.md §Feature cache
    assert bytes_per_token(576, 5, attention_mask=False) == 6917


def test_cache_round_trip_manifest_and_sizes(tmp_path):
    target, data = tiny_target(), token_data([9, 30, 5, 21])
    out = build_feature_cache(target, data, LAYERS, tmp_path / "cache", max_shard_bytes=8000, progress=False,
                              source_paths=["data/tok"])
    m = json.loads((out / "manifest.json").read_text())
    assert {k: m[k] for k in ("version", "num_samples", "target_layer_ids", "hidden_dtype", "token_dtype",
                              "mask_dtype", "index_record_size", "hidden_size")} == {
        "version": 2, "num_samples": 4, "target_layer_ids": LAYERS, "hidden_dtype": "bfloat16",
        "token_dtype": "int32", "mask_dtype": "uint8", "index_record_size": 56, "hidden_size": 32}
    assert m["num_shards"] == len(m["shards"]) > 1  # the small shard cap forced several shards
    assert [s["file_name"] for s in m["shards"]] == [f"shard-{i:05d}.bin" for i in range(m["num_shards"])]
    assert (out / "samples.idx").stat().st_size == 4 * 56
    shard_bytes = sum((out / s["file_name"]).stat().st_size for s in m["shards"])
    assert shard_bytes == (9 + 30 + 5 + 21) * bytes_per_token(32, len(LAYERS))
    rec = INDEX_RECORD.unpack((out / "samples.idx").read_bytes()[56:112])  # DeepSpec's <QIIQQQQQ
    assert rec[0] == 1 and rec[2] == 30

    ds = FeatureCacheDataset(out)
    assert len(ds) == 4 and ds.target_layer_ids == LAYERS
    for item, sample in zip(data, (ds[i] for i in range(4))):
        assert torch.equal(sample.input_ids, item["input_ids"]) and torch.equal(sample.loss_mask, item["loss_mask"])
        features, last = compute_features(target, item["input_ids"], LAYERS)
        torch.testing.assert_close(sample.target_features, features, rtol=1e-2, atol=1e-2)  # bf16 storage
        torch.testing.assert_close(sample.target_last_hidden, last, rtol=1e-2, atol=1e-2)
    assert FeatureCacheDataset(out, max_length=7)[1].input_ids.shape == (7,)
    # negative control: the tolerance is tight enough to notice another sample's features
    other, _ = compute_features(target, data[1]["input_ids"][:9], LAYERS)
    assert not torch.allclose(ds[0].target_features, other, rtol=1e-2, atol=1e-2)


class _Crash(Exception):
    pass


class _CrashingData:
    def __init__(self, data, crash_at):
        self.data, self.crash_at = data, crash_at

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == self.crash_at:
            raise _Crash()
        return self.data[i]


def test_cache_build_resumes_after_a_kill_and_torn_writes(tmp_path):
    target, data = tiny_target(), token_data([12, 7, 15, 10, 8])
    whole = build_feature_cache(target, data, LAYERS, tmp_path / "whole", max_shard_bytes=6000, progress=False)

    part = tmp_path / "part"
    with pytest.raises(_Crash):
        build_feature_cache(target, _CrashingData(data, 3), LAYERS, part, max_shard_bytes=6000, progress=False)
    assert not (part / "manifest.json").exists()
    with pytest.raises(FeatureCacheError, match="unfinished build"):
        FeatureCacheDataset(part)
    # a kill in the middle of writing: half an index record and stray shard bytes
    with open(part / "samples.idx", "ab") as f:
        f.write(b"\x01" * 20)
    last_shard = sorted(part.glob("shard-*.bin"))[-1]
    with open(last_shard, "ab") as f:
        f.write(b"\x07" * 100)
    with pytest.raises(FeatureCacheError, match="different"):
        build_feature_cache(target, data, [0, 1], part, max_shard_bytes=6000, progress=False)
    build_feature_cache(target, data, LAYERS, part, max_shard_bytes=6000, progress=False)

    for name in ["samples.idx"] + [p.name for p in whole.glob("shard-*.bin")]:
        assert (part / name).read_bytes() == (whole / name).read_bytes(), name
    assert json.loads((part / "manifest.json").read_text()) == json.loads((whole / "manifest.json").read_text())


def test_cache_must_fit_the_drafter(tmp_path):
    target = tiny_target()
    out = build_feature_cache(target, token_data([6]), LAYERS, tmp_path / "c", progress=False)
    m = FeatureCacheDataset(out).manifest
    check_cache_fits(m, LAYERS, 32)
    with pytest.raises(FeatureCacheError, match="target layers"):
        check_cache_fits(m, [1, 2], 32)
    with pytest.raises(FeatureCacheError, match="hidden size"):
        check_cache_fits(m, LAYERS, 64)
    with pytest.raises(FeatureCacheError, match="not empty"):
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / "x").write_text("x")
        build_feature_cache(target, token_data([6]), LAYERS, tmp_path / "busy", progress=False)
    with pytest.raises(FeatureCacheError, match="outside"):
        build_feature_cache(target, token_data([6]), [9], tmp_path / "c2", progress=False)


def test_training_from_the_cache_matches_training_online(tmp_path):
    """The same run on cached (bf16) features and on online features gives nearly the same losses."""
    target, data = tiny_target(), token_data([20, 24, 18, 22])
    layer_ids = target.default_layer_ids()
    cache = build_feature_cache(target, data, layer_ids, tmp_path / "cache", progress=False)
    model = {"block_size": 4, "num_anchors": 8, "markov_rank": 16}
    common = dict(drafter="dspark", max_steps=2, log_every=1, checkpoint_every=10, num_threads=1, model=model)
    train(TrainConfig(out=str(tmp_path / "online"), **common), target=target, dataset=data)
    train(TrainConfig(out=str(tmp_path / "cached"), feature_source="cache", cache_dir=str(cache), **common),
          target=target)
    losses = []
    for run in ("online", "cached"):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(ln)["loss"] for ln in lines])
    np.testing.assert_allclose(losses[0], losses[1], rtol=2e-2)


def write_token_folder(path, data):
    """A tokenized dataset folder in the layout of dspark.data.tokenized (no tokenizer needed)."""
    from dspark.data.tokenized import FORMAT_VERSION

    path.mkdir()
    lengths = [len(d["input_ids"]) for d in data]
    np.save(path / "input_ids.npy", np.concatenate([d["input_ids"].numpy() for d in data]).astype(np.int32))
    np.save(path / "loss_mask.npy", np.concatenate([d["loss_mask"].numpy() for d in data]).astype(np.uint8))
    np.save(path / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    (path / "manifest.json").write_text(json.dumps({"version": FORMAT_VERSION, "num_samples": len(data)}))
    return path


def test_data_features_command_and_online_training_from_folders(tmp_path):
    import argparse

    from dspark.data.cli import add_cli
    from tests.tiny import save_hf_folder, tiny_config

    folder = save_hf_folder(tmp_path / "target", tiny_config())
    data = token_data([14, 16])
    tok = write_token_folder(tmp_path / "tok", data)
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["data", "features", "--target", str(folder), "--data", str(tok),
                              "--out", str(tmp_path / "cache"), "--layer-ids", "0,2,3"])
    assert args.func(args) == 0
    ds = FeatureCacheDataset(tmp_path / "cache")
    assert len(ds) == 2 and ds.target_layer_ids == LAYERS and torch.equal(ds[1].input_ids, data[1]["input_ids"])
    assert parser.parse_args(["data", "regenerate", "--prompts", "p", "--out", "o"]).temperature == 0.7

    cfg = TrainConfig(drafter="dflash", target=str(folder), data=[str(tok)], out=str(tmp_path / "run"), max_steps=1,
                      num_threads=1, model={"block_size": 4, "num_anchors": 4, "target_layer_ids": LAYERS})
    assert train(cfg) == tmp_path / "run" / "step_1"
