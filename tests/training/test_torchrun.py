"""`torchrun --nproc_per_node 2` on CPU (gloo): DDP training from a target folder and a feature cache, equal to
one process at the same global batch (sharded feature builds: tests/data/test_features.py; FSDP: test_fsdp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch

from dspark.target.model import load_target
from dspark.data.features import build_feature_cache
from tests.tiny import save_hf_folder, tiny_config

LAYERS = [0, 2, 3]


def test_torchrun_two_cpu_processes_train_and_checkpoint(tmp_path):
    folder = save_hf_folder(tmp_path / "target", tiny_config())
    target = load_target(str(folder), tokenizer=False)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(2, 96, (20,), generator=g), "loss_mask": torch.ones(20, dtype=torch.long)}
            for _ in range(4)]
    cache = build_feature_cache(target, data, LAYERS, tmp_path / "cache", progress=False)
    out = tmp_path / "run"
    cfg = {
        "_command": "torchrun --nproc_per_node 2 -m dspark.cli train --config cfg.json",
        "drafter": "dspark", "target": str(folder), "out": str(out), "feature_source": "cache",
        "cache_dir": str(cache), "max_steps": 2, "checkpoint_every": 2, "log_every": 1, "num_threads": 1,
        "val_cache_dir": str(cache), "val_samples": 3,  # 3 held-out sequences: one rank validates 2, the other 1
        "model": {"block_size": 4, "num_anchors": 8, "markov_rank": 16, "target_layer_ids": LAYERS},
    }
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "dspark.cli", "train", "--config", str(cfg_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = out / "step_2"
    assert (out / "step_latest").resolve() == step.resolve()
    assert {p.name for p in step.iterdir()} == {"model.safetensors", "config.json", "train_config.json",
                                                 "training_state.rank0.pt", "training_state.rank1.pt"}
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 2 and summary["steps"] == 2
    assert summary["tokens_seen"] == 2 * 2 * 20  # two ranks, one sequence each, two steps
    # the replicas stayed in sync: both ranks hold the same master weights
    s0, s1 = (torch.load(step / f"training_state.rank{r}.pt", weights_only=True) for r in (0, 1))
    for a, b in zip(s0["master_weights"], s1["master_weights"], strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert "last checkpoint:" in proc.stdout
    # the same global batch in one process (grad_accum 2) trains the same weights
    from safetensors.torch import load_file

    from dspark.training.config import load_config
    from dspark.training.trainer import train

    one = train(load_config(None, **{**{k: v for k, v in cfg.items() if not k.startswith("_")},
                                     "out": str(tmp_path / "one"), "global_batch_size": 2}))
    wa, wb = load_file(step / "model.safetensors"), load_file(one / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=k)
    # validation over two ranks is the one-process validation: every sequence once, the same anchors
    val_two = summary["val_metrics"]
    val_one = json.loads((tmp_path / "one" / "train_summary.json").read_text())["val_metrics"]
    assert set(val_two) == set(val_one) and "val_tau" in val_two
    for k in val_one:
        assert abs(val_two[k] - val_one[k]) <= 1e-4 * max(1.0, abs(val_one[k])), k
