"""Training checkpoints: ``out/step_N`` folders written atomically, ``step_latest``, pruning, resume state.

Layout::

    out/step_N/            model.safetensors + config.json (the drafter's own format),
                           train_config.json, training_state.rank{r}.pt
    out/step_latest        symlink to the newest step_N (written atomically, after the folder)

A resume needs only what ``training_state.rank{r}.pt`` holds: fp32 master weights, AdamW
moments, the scheduler, the RNG states and the step.

Nothing a kill -9 interrupts is ever visible under a ``step_N`` name: a checkpoint is written into
``.step_N.tmp`` and renamed, ``step_latest`` is repointed by an atomic rename, and a pruned folder is
renamed to ``.step_N.deleting`` before it is removed. So every ``step_N`` folder is complete, and a
resume whose ``step_latest`` is missing or dangling falls back to the newest complete ``step_N``.
Pruning only ever removes checkpoints older than the one just written.
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

from dspark.errors import BadFileError, DSparkError
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
    """The folder ``out/step_latest`` points to, or None when the link is missing or dangling."""
    link = Path(out) / LATEST
    return link.resolve() if link.exists() else None


def checkpoint_folders(out: str | Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` folder in ``out`` as (N, folder), oldest first (``step_latest`` excluded)."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = ((p.name.removeprefix("step_"), p) for p in out.glob("step_*") if p.is_dir() and not p.is_symlink())
    return sorted((int(n), p) for n, p in found if n.isdigit())


def is_complete(folder: Path) -> bool:
    """A folder a resume can start from: rank 0's training state is there (it is written first)."""
    return (folder / "training_state.rank0.pt").is_file()


def resume_checkpoint(out: str | Path) -> Path | None:
    """The checkpoint ``--resume`` continues from: ``step_latest``, else the newest complete ``step_N``.

    None when ``out`` holds no checkpoint at all (the run starts at step 0); a ``DSparkError`` when it
    holds some but none is complete.
    """
    out = Path(out)
    latest = latest_checkpoint(out)
    if latest is not None and is_complete(latest):
        return latest
    complete = [folder for _, folder in checkpoint_folders(out) if is_complete(folder)]
    if complete:
        return complete[-1]
    link = out / LATEST
    if link.is_symlink() or checkpoint_folders(out):
        raise DSparkError(f"cannot resume: {out} holds no complete checkpoint (step_latest -> "
                          f"{os.readlink(link) if link.is_symlink() else 'nothing'}, and no step_N folder holds "
                          "training_state.rank0.pt); pass --overwrite to start afresh")
    return None


#: what a run writes into its folder besides step_N (removed by --overwrite)
RUN_FILES = (LATEST, "tb", "metrics.jsonl", "train_summary.json")


def prepare_run_folder(out: Path, d: DistInfo, resume: bool, overwrite: bool) -> Path | None:
    """Check ``out`` before a run and return the checkpoint to resume from (None: start at step 0).

    A new run refuses a folder that holds checkpoints unless ``overwrite`` (which deletes them and the
    run's logs); ``resume`` continues from ``resume_checkpoint``. Leftovers of interrupted writes go.
    """
    if resume and overwrite:
        raise DSparkError("--resume continues the checkpoints in --out and --overwrite deletes them; pass one")
    start = resume_checkpoint(out) if resume else None
    existing = checkpoint_folders(out)
    if not resume and (existing or (out / LATEST).is_symlink()):
        if not overwrite:
            names = ", ".join(p.name for _, p in existing) or f"a {LATEST} link"
            raise DSparkError(f"{out} already holds checkpoints ({names}); pass --resume to continue from them, "
                              "--overwrite to delete them and start afresh, or choose another --out")
        if d.is_main:
            for _, folder in existing:
                _remove(folder)
            for name in RUN_FILES:
                path = out / name
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.is_dir():
                    shutil.rmtree(path)
    if d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        for leftover in out.glob(".step_*"):  # .step_N.tmp / .old / .deleting, .step_latest.tmp
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
    barrier(d)
    if resume and d.is_main:
        latest = latest_checkpoint(out)
        if start is not None and start != latest:
            print(f"[dspark] {out / LATEST} is missing, dangling or incomplete; resuming from the newest complete "
                  f"checkpoint {start}", flush=True)
        elif start is None:
            print(f"[dspark] --resume: {out} holds no checkpoint yet, starting at step 0", flush=True)
    return start


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
        model.save_checkpoint(tmp, getattr(torch, cfg.save_dtype))  # bf16 by default; loaders read any
        # "_run" is a comment key to the config loader: the file works as --config again
        (tmp / "train_config.json").write_text(json.dumps({"_run": extra_config, **cfg.to_dict()}, indent=2))
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            _remove(final)
        tmp.rename(final)
        link_tmp = out / f".{LATEST}.tmp"
        if link_tmp.is_symlink() or link_tmp.exists():
            link_tmp.unlink()
        os.symlink(final.name, link_tmp)
        os.replace(link_tmp, out / LATEST)
        if cfg.keep_checkpoints:
            prune_checkpoints(out, cfg.keep_checkpoints, step)
    barrier(d)
    return final


def prune_checkpoints(out: Path, keep: int, step: int) -> None:
    """Keep the newest ``keep`` checkpoints up to ``step_{step}`` (the one just written, always kept).

    Folders numbered above ``step`` are not this run's history (e.g. left by an earlier run) and stay.
    """
    older = [folder for n, folder in checkpoint_folders(out) if n < step]
    for folder in older[: max(0, len(older) - (keep - 1))]:
        _remove(folder)


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder; it leaves its ``step_N`` name first, so no half-deleted step_N is seen."""
    doomed = folder.with_name(f".{folder.name}.deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


#: what every training_state.rank{r}.pt holds (``Trainer._save``)
STATE_KEYS = ("step", "master_weights", "optimizer", "scheduler", "rng", "tokens_seen", "train_seconds")


def load_training_state(folder: Path, rank: int, params: list[torch.Tensor] | None = None) -> dict:
    """This rank's training state in ``folder``, checked (keys, and against ``params`` when given).

    Raises ``BadFileError`` naming the file when it is missing, truncated or does not fit the model.
    """
    path = folder / f"training_state.rank{rank}.pt"
    if not path.exists():  # a different world size: replicas hold the same weights and optimizer state
        path = folder / "training_state.rank0.pt"
    if not path.exists():
        raise BadFileError(f"{folder} holds no training_state.rank*.pt; it is not a resumable checkpoint")

    def bad(what: str) -> BadFileError:
        return BadFileError(f"training state {path} {what}; resume from another step_N or start afresh with "
                            "--overwrite")

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, EOFError, UnpicklingError, ...)
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise bad(f"is truncated or corrupt ({first_line})") from None
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        raise bad(f"lacks {', '.join(missing)}")
    weights = state["master_weights"]
    if isinstance(state["step"], bool) or not isinstance(state["step"], int) or state["step"] < 0:
        raise bad(f"has step {state['step']!r}, not an integer >= 0")
    if not isinstance(weights, list) or not all(isinstance(w, torch.Tensor) for w in weights):
        raise bad("has master_weights that are not a list of tensors")
    if params is not None:
        shapes, expected = [tuple(w.shape) for w in weights], [tuple(p.shape) for p in params]
        if shapes != expected:
            raise bad(f"holds {len(shapes)} weight tensors that do not fit the model's {len(expected)} trainable "
                      "parameters (a different drafter config?)")
    return state
