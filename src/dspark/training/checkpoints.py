"""Training checkpoints: ``out/step_N`` folders written atomically, ``step_latest``, pruning, resume state.

Layout::

    out/step_N/            model.safetensors + config.json (the drafter's own format),
                           train_config.json, training_state.rank{r}.pt
    out/step_latest        symlink to the newest step_N (written atomically, after the folder)

A resume needs only what ``training_state.rank{r}.pt`` holds: fp32 master weights, AdamW
moments, the scheduler, the RNG states and the step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dspark.errors import DSparkError
from dspark.training.config import TrainConfig
from dspark.training.distributed import DistInfo, barrier

#: the symlink in a run folder that points to its newest checkpoint
LATEST = "step_latest"


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


def latest_checkpoint(out: str | Path) -> Path | None:
    link = Path(out) / LATEST
    return link.resolve() if link.exists() else None


def write_checkpoint(out: Path, step: int, model: nn.Module, cfg: TrainConfig, state: dict, d: DistInfo,
                      extra_config: dict) -> Path:
    """Write ``out/step_N`` atomically (temp folder, rename), then repoint ``step_latest``."""
    final = out / f"step_{step}"
    tmp = out / f".step_{step}.tmp"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(d)
    torch.save(state, tmp / f"training_state.rank{d.rank}.pt")
    barrier(d)
    if d.is_main:
        model.save_checkpoint(tmp)
        # "_run" is a comment key to the config loader: the file works as --config again
        (tmp / "train_config.json").write_text(json.dumps({"_run": extra_config, **cfg.to_dict()}, indent=2))
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            old = out / f".step_{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        link_tmp = out / f".{LATEST}.tmp"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(final.name, link_tmp)
        os.replace(link_tmp, out / LATEST)
        if cfg.keep_checkpoints:
            prune_checkpoints(out, cfg.keep_checkpoints)
    barrier(d)
    return final


def prune_checkpoints(out: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` step_N folders (step_latest always points to a kept one)."""
    steps = sorted((int(p.name.removeprefix("step_")), p) for p in out.glob("step_*")
                   if p.is_dir() and not p.is_symlink() and p.name.removeprefix("step_").isdigit())
    for _, folder in steps[:-keep]:
        shutil.rmtree(folder, ignore_errors=True)


def load_training_state(folder: Path, rank: int) -> dict:
    path = folder / f"training_state.rank{rank}.pt"
    if not path.exists():  # a different world size: replicas hold the same weights and optimizer state
        path = folder / "training_state.rank0.pt"
    if not path.exists():
        raise DSparkError(f"{folder} holds no training_state.rank*.pt; it is not a resumable checkpoint")
    return torch.load(path, map_location="cpu", weights_only=True)
