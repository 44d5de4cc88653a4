"""The budget table of a study's training runs (docs/reports/training-runs.md), from what `dspark train` leaves behind.

Reads each run's ``train_summary.json`` and ``step_latest/train_config.json`` and reports the budget (wall-clock
cap, steps, sequences, tokens), the measured training throughput and the parameter counts of the checkpoint.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Sequence

from dspark.tables import markdown_table


def parameter_counts(run: Path) -> tuple[int, int] | None:
    """(trainable, total) parameter counts of the last checkpoint, from its safetensors header."""
    ckpt = run / "step_latest"
    files = sorted(ckpt.glob("*.safetensors")) if ckpt.exists() else []
    if not files:
        return None
    from safetensors import safe_open

    total = frozen = 0
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                n = 1
                for d in fh.get_slice(k).get_shape():
                    n *= d
                total += n
                if k.split(".")[0] in ("embed_tokens", "lm_head") or k.startswith(("model.embed_tokens", "lm_head")):
                    frozen += n
    return total - frozen, total


def _row(run: Path, name: str) -> list[str]:
    from dspark.training.trainer import recent_mean
    s = json.loads((run / "train_summary.json").read_text())
    cfg_path = run / "step_latest" / "train_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    params = parameter_counts(run)
    tau = recent_mean(run, "tau")
    budget = cfg.get("time_budget_s")
    budget = f"{budget:g} s" if budget else f"{cfg.get('max_steps') or '?'} steps"
    return [name, cfg.get("drafter", "?"), cfg.get("dtype", "float32"), budget, str(s["steps"]),
            str(s["global_batch"]), str(s["steps"] * s["global_batch"]), f"{s['tokens_seen']:.0f}",
            f"{s['train_seconds_total']:.0f}", f"{s['tokens_per_s']:.0f}",
            f"{params[0] / 1e6:.1f}M / {params[1] / 1e6:.1f}M" if params else "?",
            f"{tau:.2f}" if isinstance(tau, (int, float)) else "-"]


def training_runs_markdown(folders: Sequence[str | Path], command: str) -> str:
    """The page: one row per run folder (with a train_summary.json) under each of ``folders``."""
    runs = sorted(r for folder in folders for r in Path(folder).iterdir() if (r / "train_summary.json").is_file())
    rows = [_row(run, f"{run.parent.name}/{run.name}" if len(folders) > 1 else run.name) for run in runs]
    lines = [
        "# Training runs",
        "",
        f"Written by `{command}` from each run's `train_summary.json`. Machine: "
        f"{platform.machine()}, {platform.processor() or 'CPU'}; "
        "tokens/s counts the tokens of the sequences trained on per wall-clock second of training.",
        "",
        *markdown_table(["run", "drafter", "dtype", "budget", "optimizer steps", "sequences/step", "sequences seen",
                         "tokens seen", "train seconds", "tokens/s", "trainable / total params",
                         "train-time tau estimate (last 100 logged steps)"], rows),
    ]
    return "\n".join(lines) + "\n"
