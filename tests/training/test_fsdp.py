"""``parallel: fsdp`` (FSDP2) under ``torchrun --nproc_per_node 2`` on CPU (gloo): the same result as one process
at the same global batch, checkpoints in the one-process layout, resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dspark.data.features import build_feature_cache
from dspark.target.model import load_target
from dspark.training.config import TrainConfigError, load_config
from dspark.training.trainer import train
from tests.tiny import save_hf_folder, tiny_config

LAYERS = [0, 2, 3]
MODEL = {"block_size": 4, "num_anchors": 8, "markov_rank": 16, "target_layer_ids": LAYERS}


def _torchrun(tmp_path, cfg: dict, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "dspark.cli", "train", "--config", str(path), *extra],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(run) -> list[float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [d["loss"] for d in lines if "loss" in d]  # not the held-out validation's val_* lines


def _assert_weights_close(a, b) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    folder = save_hf_folder(tmp / "target", tiny_config())
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(2, 96, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.long)}
            for n in (20, 17, 23, 19, 21, 18)]
    cache = build_feature_cache(load_target(str(folder), tokenizer=False), data, LAYERS, tmp / "cache",
                                progress=False)
    base = {"drafter": "dspark", "target": str(folder), "feature_source": "cache", "cache_dir": str(cache),
            "max_steps": 3, "checkpoint_every": 1, "log_every": 1, "num_threads": 1, "global_batch_size": 2,
            "warmup_ratio": 0.34, "model": MODEL,
            "val_cache_dir": str(cache), "val_samples": 3}  # 3 validation sequences: the ranks' shares differ
    single = train(load_config(None, **{**base, "out": str(tmp / "single")}))  # grad_accum 2 in one process
    return tmp, base, single


def test_fsdp_on_two_processes_matches_one_process_and_resumes(setup, tmp_path):
    _, base, single = setup
    out = tmp_path / "fsdp"
    proc = _torchrun(tmp_path, {**base, "out": str(out), "parallel": "fsdp"})
    assert "last checkpoint:" in proc.stdout
    step = out / "step_3"
    # the one-process layout: full drafter weights, config, unsharded training state per rank
    assert {p.name for p in step.iterdir()} == {"model.safetensors", "config.json", "train_config.json",
                                                 "training_state.rank0.pt", "training_state.rank1.pt"}
    _assert_weights_close(step, single)
    with pytest.raises(AssertionError):  # negative control: one step apart is far outside the tolerance
        _assert_weights_close(out / "step_2", single)
    ours, ref = _losses(out), _losses(single.parent)
    assert len(ours) == len(ref) == 3
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    s0 = torch.load(step / "training_state.rank0.pt", weights_only=True)
    r0 = torch.load(single / "training_state.rank0.pt", weights_only=True)
    for a, b in zip(s0["master_weights"], r0["master_weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # gathered: whole tensors, not shards
    assert s0["optimizer"]["state"].keys() == r0["optimizer"]["state"].keys()
    # validation through the sharded drafter: every rank the same number of forwards, the one-process values
    val_fsdp, val_one = (json.loads((run / "train_summary.json").read_text())["val_metrics"] for run in (out, single.parent))
    assert set(val_fsdp) == set(val_one) and "val_tau" in val_one
    for k in val_one:
        assert abs(val_fsdp[k] - val_one[k]) <= 1e-4 * max(1.0, abs(val_one[k])), k

    # kill after step 2: drop step_3 and step_latest, resume, and step 3 comes out the same again
    shutil.rmtree(step)
    (out / "step_latest").unlink()
    proc = _torchrun(tmp_path, {**base, "out": str(out), "parallel": "fsdp"}, "--resume")
    assert "resuming from" in proc.stdout
    _assert_weights_close(out / "step_3", single)


def test_fsdp_with_online_features_shards_the_target_layers(setup, tmp_path):
    tmp, base, single = setup
    tok = tmp / "tok"
    if not tok.exists():
        from tests.data.test_features import write_token_folder
        from dspark.data.features import FeatureCacheDataset

        cache = FeatureCacheDataset(base["cache_dir"])
        write_token_folder(tok, [{"input_ids": cache[i].input_ids, "loss_mask": cache[i].loss_mask}
                                 for i in range(len(cache))])
    cfg = {**base, "feature_source": "online", "cache_dir": None, "data": [str(tok)], "max_steps": 2}
    one = train(load_config(None, **{**cfg, "out": str(tmp_path / "one")}))
    _torchrun(tmp_path, {**cfg, "out": str(tmp_path / "online"), "parallel": "fsdp"})
    _assert_weights_close(tmp_path / "online" / "step_2", one)
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "online")), torch.tensor(_losses(one.parent)),
                               rtol=1e-4, atol=1e-5)


def test_parallel_must_be_ddp_or_fsdp():
    with pytest.raises(TrainConfigError, match="parallel must be ddp or fsdp"):
        load_config(None, parallel="zero3")
