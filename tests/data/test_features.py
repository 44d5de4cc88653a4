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
from dspark.target.model import load_target
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
    assert bytes_per_token(576, 5, logsumexp=True) == 6922  # + the float32 log-sum-exp of our builds


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
    assert shard_bytes == (9 + 30 + 5 + 21) * bytes_per_token(32, len(LAYERS), logsumexp=True)
    assert m["target_logsumexp_dtype"] == "float32" and m["vocab_size"] == 96 and m["num_target_layers"] == 4
    rec = INDEX_RECORD.unpack((out / "samples.idx").read_bytes()[56:112])  # DeepSpec's <QIIQQQQQ
    assert rec[0] == 1 and rec[2] == 30

    ds = FeatureCacheDataset(out)
    assert len(ds) == 4 and ds.target_layer_ids == LAYERS
    for item, sample in zip(data, (ds[i] for i in range(4))):
        assert torch.equal(sample.input_ids, item["input_ids"]) and torch.equal(sample.loss_mask, item["loss_mask"])
        features, last = compute_features(target, item["input_ids"], LAYERS)
        torch.testing.assert_close(sample.target_features, features, rtol=1e-2, atol=1e-2)  # bf16 storage
        torch.testing.assert_close(sample.target_last_hidden, last, rtol=1e-2, atol=1e-2)
        # the log-normaliser of the target's full distribution, from the stored bf16 hidden state
        lse = torch.logsumexp(target.model.logits(last.to(torch.bfloat16).float()), -1)
        torch.testing.assert_close(sample.target_logsumexp, lse, rtol=1e-5, atol=1e-5)
    assert FeatureCacheDataset(out, max_length=7)[1].input_ids.shape == (7,)
    # negative control: the tolerance is tight enough to notice another sample's features
    other, _ = compute_features(target, data[1]["input_ids"][:9], LAYERS)
    assert not torch.allclose(ds[0].target_features, other, rtol=1e-2, atol=1e-2)


class _Crash(Exception):
    pass


class _CrashingData:
    """A dataset whose item ``crash_at`` kills the build; its lengths are known up front, as a tokenized
    folder's are (the build reads them to state the cache's size)."""

    def __init__(self, data, crash_at):
        self.data, self.crash_at = data, crash_at
        self.lengths = [len(d["input_ids"]) for d in data]

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
    (path / "manifest.json").write_text(json.dumps({"version": FORMAT_VERSION, "num_samples": len(data),
                                                    "num_tokens": int(sum(lengths))}))
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


# --------------------------------------------------------------------------- bad caches


def test_empty_and_corrupt_caches_are_one_line_errors_naming_the_file(tmp_path):
    import shutil

    target = tiny_target()
    good = build_feature_cache(target, token_data([12, 9, 15]), LAYERS, tmp_path / "good", progress=False)

    def copy(name):
        return shutil.copytree(good, tmp_path / name)

    bad = copy("json")
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(FeatureCacheError, match=r"json/manifest.json is not readable JSON"):
        FeatureCacheDataset(bad)
    bad = copy("empty")
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**m, "num_samples": 0}))
    (bad / "samples.idx").write_bytes(b"")
    with pytest.raises(FeatureCacheError, match="empty"):
        FeatureCacheDataset(bad)
    bad = copy("short")
    shard = bad / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-50])  # truncated
    with pytest.raises(FeatureCacheError, match="shard-00000.bin is shorter than samples.idx says"):
        FeatureCacheDataset(bad)
    bad = copy("index")
    raw = bytearray((bad / "samples.idx").read_bytes())
    raw[56 + 16 : 56 + 24] = (10**6).to_bytes(8, "little")  # the second sample's input_ids offset
    (bad / "samples.idx").write_bytes(bytes(raw))
    with pytest.raises(FeatureCacheError, match="samples.idx: record 1 has inconsistent offsets"):
        FeatureCacheDataset(bad)
    FeatureCacheDataset(good)[2]  # the original still reads


def test_a_cache_from_another_target_or_layer_set_is_refused_by_name(tmp_path):
    from dspark.training.samples import build_sample_source

    target = tiny_target()
    cache = build_feature_cache(target, token_data([12, 9]), LAYERS, tmp_path / "c", progress=False)
    cfg = TrainConfig(drafter="dspark", out=str(tmp_path / "o"), feature_source="cache", cache_dir=str(cache))
    build_sample_source(cfg, target, LAYERS, torch.float32)  # fits
    with pytest.raises(FeatureCacheError, match=r"c/manifest.json holds target layers \[0, 2, 3\]"):
        build_sample_source(cfg, target, [0, 1, 3], torch.float32)
    with pytest.raises(FeatureCacheError, match="c/manifest.json was built from another target"):
        build_sample_source(cfg, tiny_target(seed=3), LAYERS, torch.float32)
    with pytest.raises(FeatureCacheError, match="vocab_size 96, the target 128"):
        build_sample_source(cfg, tiny_target(vocab_size=128), LAYERS, torch.float32)


def test_auto_feature_source_builds_the_cache_once_and_trains_with_a_draft_vocabulary(tmp_path):
    """The default feature_source builds OUT/feature-cache on the first run; a draft vocabulary from the data
    lands in the checkpoint."""
    from dspark.drafters.dspark.model import DSparkModel

    target, data = tiny_target(), token_data([20, 24, 18, 22])
    folder = write_token_folder(tmp_path / "tok", data)
    model = {"block_size": 4, "num_anchors": 8, "markov_rank": 16}
    cfg = TrainConfig(drafter="dspark", out=str(tmp_path / "run"), data=[str(folder)], max_steps=2,
                      num_threads=1, model=model, draft_vocab_size=40)
    assert cfg.feature_source == "auto"
    ckpt = train(cfg, target=target)
    assert (tmp_path / "run" / "feature-cache" / "manifest.json").is_file()
    saved = json.loads((tmp_path / "run" / "draft-vocab.json").read_text())
    back = DSparkModel.from_checkpoint(ckpt, target)
    assert back.draft_vocab.tolist() == saved["token_ids"] and back.draft_size == 40
    assert set(target.eos_token_ids) <= set(saved["token_ids"])


# --------------------------------------------------------------------------- sharded builds (torchrun)


def _assert_same_samples(a: FeatureCacheDataset, b: FeatureCacheDataset) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        for name in ("input_ids", "loss_mask", "target_features", "target_last_hidden", "target_logsumexp"):
            torch.testing.assert_close(getattr(x, name), getattr(y, name), rtol=0, atol=0, msg=f"{name} of {i}")


def test_a_sharded_build_in_two_parts_merges_into_the_one_process_cache(tmp_path):
    """Ranks simulated one after another in a one-process gloo group (barriers pass at once)."""
    import torch.distributed as dist

    target, data = tiny_target(), token_data([12, 7, 15, 10, 8])
    whole = build_feature_cache(target, data, LAYERS, tmp_path / "whole", max_shard_bytes=6000, progress=False)
    out = tmp_path / "sharded"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        kw = dict(max_shard_bytes=6000, progress=False, world_size=2)
        with pytest.raises(FeatureCacheError, match="parts hold 3 samples, not the 5"):  # rank 1 has not run
            build_feature_cache(target, data, LAYERS, out, rank=0, **kw)
        assert not (out / "manifest.json").exists() and not (out / "merge.json").exists()
        with pytest.raises(FeatureCacheError, match="same number"):  # each rank resumes its own part
            build_feature_cache(target, data, LAYERS, out, max_shard_bytes=6000, progress=False)
        build_feature_cache(target, data, LAYERS, out, rank=1, **kw)
        build_feature_cache(target, data, LAYERS, out, rank=0, **kw)  # part 0 is done: merge only
    finally:
        dist.destroy_process_group()
    m = json.loads((out / "manifest.json").read_text())
    assert m["num_shards"] > 2 and sorted(p.name for p in out.iterdir()) == sorted(
        ["build_info.json", "manifest.json", "samples.idx"] + [f"shard-{s:05d}.bin" for s in range(m["num_shards"])])
    _assert_same_samples(FeatureCacheDataset(out), FeatureCacheDataset(whole))
    assert build_feature_cache(target, data, LAYERS, out, progress=False) == out  # finished: any process count


def test_torchrun_two_cpu_processes_build_the_one_process_cache(tmp_path):
    import os
    import subprocess
    import sys

    from tests.tiny import save_hf_folder, tiny_config

    folder = save_hf_folder(tmp_path / "target", tiny_config())
    data = token_data([14, 16, 9, 21, 11])
    tok = write_token_folder(tmp_path / "tok", data)
    from dspark.data.features import labelling_dtype
    from dspark.target.loading import torch_dtype

    as_the_command = load_target(str(folder), tokenizer=False, fuse=True, dtype=torch_dtype(labelling_dtype("cpu")))
    whole = build_feature_cache(as_the_command, data, LAYERS, tmp_path / "whole", progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "dspark.cli", "data", "features", "--target", str(folder), "--data", str(tok),
         "--out", str(tmp_path / "cache"), "--layer-ids", "0,2,3", "--shard-gb", str(5000 / 2**30)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("5 sequences (2 process(es))") == 1  # rank 0 reports
    _assert_same_samples(FeatureCacheDataset(tmp_path / "cache"), FeatureCacheDataset(whole))
    assert not list((tmp_path / "cache").glob("part-*"))


def test_several_caches_train_as_one_dataset_in_list_order(tmp_path):
    """cache_dir as a list reads the caches as one dataset: two halves in order train exactly as the whole."""
    target, data = tiny_target(), token_data([20, 24, 18, 22])
    layer_ids = target.default_layer_ids()
    whole = build_feature_cache(target, data, layer_ids, tmp_path / "whole", progress=False)
    first = build_feature_cache(target, data[:2], layer_ids, tmp_path / "first", progress=False)
    second = build_feature_cache(target, data[2:], layer_ids, tmp_path / "second", progress=False)
    model = {"block_size": 4, "num_anchors": 8, "markov_rank": 16}
    common = dict(drafter="dspark", max_steps=2, log_every=1, checkpoint_every=10, num_threads=1, model=model,
                  feature_source="cache")

    def losses(name, cache_dir):
        train(TrainConfig(out=str(tmp_path / name), cache_dir=cache_dir, **common), target=target)
        return [json.loads(ln)["loss"] for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    reference = losses("whole", str(whole))
    assert losses("split", [str(first), str(second)]) == reference
    assert losses("swapped", [str(second), str(first)]) != reference  # order matters: the check is informative
    with pytest.raises(Exception, match="no finished feature cache"):
        train(TrainConfig(out=str(tmp_path / "bad"), cache_dir=[str(first), str(tmp_path / "nope")],
                          **{**common, "feature_source": "auto"}), target=target)


# --------------------------------------------------------------------------- slices and disk space


def _features_cli(tmp_path, *extra):
    import argparse

    from dspark.data.cli import add_cli
    from tests.tiny import save_hf_folder, tiny_config

    folder = tmp_path / "target"
    if not folder.exists():
        save_hf_folder(folder, tiny_config())
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["data", "features", "--target", str(folder), "--layer-ids", "0,2,3", *extra])
    return args.func(args)


def test_slices_cache_their_sequences_and_a_resume_with_another_slice_is_refused(tmp_path):
    data = token_data([14, 16, 9, 12])
    tok = write_token_folder(tmp_path / "tok", data)
    out = tmp_path / "slice"
    assert _features_cli(tmp_path, "--data", str(tok), "--out", str(out), "--skip", "1", "--limit", "2") == 0
    ds = FeatureCacheDataset(out)
    assert len(ds) == 2
    assert torch.equal(ds[0].input_ids, data[1]["input_ids"]) and torch.equal(ds[1].input_ids, data[2]["input_ids"])
    (out / "manifest.json").unlink()  # as if killed before the end: a resume must be the same slice
    with pytest.raises(FeatureCacheError, match="source_start"):
        _features_cli(tmp_path, "--data", str(tok), "--out", str(out), "--skip", "2", "--limit", "2")
    from dspark.errors import DSparkError

    with pytest.raises(DSparkError, match="--skip 4 leaves none"):
        _features_cli(tmp_path, "--data", str(tok), "--out", str(tmp_path / "x"), "--skip", "4")


def test_planned_size_is_the_written_size(tmp_path):
    from dspark.data.features import planned_cache_bytes

    target, data = tiny_target(), token_data([9, 30, 5, 21])
    out = build_feature_cache(target, data, LAYERS, tmp_path / "cache", max_length=20, progress=False)
    tokens, size = planned_cache_bytes(data, len(LAYERS), 32, max_length=20)
    assert tokens == 9 + 20 + 5 + 20
    written = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("shard-") or f.name == "samples.idx")
    assert size == written


def test_a_cache_the_disk_cannot_hold_is_refused_before_labelling(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    target, data = tiny_target(), token_data([9, 30, 5, 21])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(FeatureCacheError, match=r"needs .* GiB more but the disk has .* GiB free"):
        build_feature_cache(target, data, LAYERS, tmp_path / "cache", progress=True)
    assert "4 sequences, 65 tokens" in capsys.readouterr().err  # the size is stated before anything is written
    assert not list((tmp_path / "cache").glob("shard-*"))
    monkeypatch.undo()  # with room, the same folder builds
    build_feature_cache(target, data, LAYERS, tmp_path / "cache", progress=False)
    assert len(FeatureCacheDataset(tmp_path / "cache")) == 4


# --------------------------------------------------------------------------- other tokenizers, layer subsets


def test_data_from_another_tokenizer_is_refused_naming_the_folder(tmp_path):
    from dspark.data.tokenized import check_tokenizer, tokenizer_fingerprint
    from dspark.errors import BadFileError
    from tests.tiny import save_word_tokenizer

    folder = save_hf_folder_with_tokenizer(tmp_path / "target", vocab_size=96)
    target = load_target(str(folder))
    tok = write_token_folder(tmp_path / "tok", token_data([14, 16]))
    manifest = json.loads((tok / "manifest.json").read_text())
    (tmp_path / "other").mkdir()
    other = save_word_tokenizer(tmp_path / "other", 96)  # the same size, another split of the probe text
    from dspark.target.model import load_tokenizer

    (tok / "manifest.json").write_text(json.dumps(
        {**manifest, "tokenizer": "other", "tokenizer_fingerprint": tokenizer_fingerprint(load_tokenizer(other))}))
    check_tokenizer([tok], target)  # a word-level tokenizer of the same words splits the probe alike
    (tok / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": "other",
                                                   "tokenizer_fingerprint": "0123456789abcdef"}))
    with pytest.raises(BadFileError, match=r"tok/manifest.json was made by tokenizer 'other'"):
        check_tokenizer([tok], target)
    (tok / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 200}))
    with pytest.raises(BadFileError, match="tokenizer of 200 tokens, more than the target's vocabulary of 96"):
        check_tokenizer([tok], target)
    (tok / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_fingerprint": "0123456789abcdef"}))
    with pytest.raises(BadFileError, match="not the target's"):  # the features command checks it too
        _features_cli(tmp_path, "--data", str(tok), "--out", str(tmp_path / "cache"))


def save_hf_folder_with_tokenizer(path, vocab_size):
    from tests.tiny import save_hf_folder, save_word_tokenizer, tiny_config

    save_hf_folder(path, tiny_config(vocab_size=vocab_size))
    save_word_tokenizer(path, vocab_size)
    return path


def test_a_cache_serves_a_drafter_that_reads_a_subset_of_its_layers(tmp_path):
    target, data = tiny_target(), token_data([9, 13])
    out = build_feature_cache(target, data, LAYERS, tmp_path / "cache", progress=False)
    ds = FeatureCacheDataset(out)
    full = ds[1].target_features  # (L, 3H)
    ds.select_layers([3, 0])
    part = ds[1].target_features  # (L, 2H), in the asked order
    H = 32
    assert torch.equal(part, torch.cat([full[:, 2 * H:], full[:, :H]], dim=1))
    ref, _ = compute_features(target, data[1]["input_ids"], [3, 0])
    torch.testing.assert_close(part.float(), ref.to(torch.bfloat16).float())
    check_cache_fits(ds.manifest, [0, 3], 32)  # a subset fits
    with pytest.raises(FeatureCacheError, match=r"reads \[0, 1\]"):
        check_cache_fits(ds.manifest, [0, 1], 32)
    with pytest.raises(FeatureCacheError, match=r"not \[1\]"):
        ds.select_layers([0, 1])
