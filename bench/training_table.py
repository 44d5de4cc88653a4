"""Write docs/training.md's budget table from the training runs of a study.

    python bench/training_table.py --runs runs/study/train --out docs/training-runs.md

Reads each run's train_summary.json and train_config.json (written by `dspark train`) and reports the
budget (wall-clock cap, steps, sequences, tokens) and the measured training throughput.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path


def _params(run: Path) -> tuple[int, int] | None:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=["runs/study/train"],
                    help="folders with one sub-folder per training run")
    ap.add_argument("--out", default="docs/training-runs.md")
    args = ap.parse_args()
    rows = []
    for run in sorted(r for folder in args.runs for r in Path(folder).iterdir()):
        summary_path = run / "train_summary.json"
        if not summary_path.is_file():
            continue
        s = json.loads(summary_path.read_text())
        cfg = json.loads((run / "step_latest" / "train_config.json").read_text()) if (run / "step_latest" / "train_config.json").is_file() else {}
        p = _params(run)
        fm = s.get("final_metrics", {})
        name = f"{run.parent.name}/{run.name}" if len(args.runs) > 1 else run.name
        budget = cfg.get("time_budget_s")
        budget = f"{budget:g} s" if budget else f"{cfg.get('max_steps') or '?'} steps"
        rows.append((name, cfg.get("drafter", "?"), cfg.get("dtype", "float32"), budget, s["steps"], s["global_batch"],
                     s["steps"] * s["global_batch"], s["tokens_seen"], s["train_seconds_total"], s["tokens_per_s"],
                     p, fm.get("tau")))
    lines = [
        "# Training runs",
        "",
        f"Written by `python bench/training_table.py --runs {' '.join(args.runs)} --out {args.out}` from each run's "
        "`train_summary.json`. Machine: " + f"{platform.machine()}, {platform.processor() or 'CPU'}; "
        "tokens/s counts the tokens of the sequences trained on per wall-clock second of training.",
        "",
        "| run | drafter | dtype | budget | optimizer steps | sequences/step | sequences seen | tokens seen "
        "| train seconds | tokens/s | trainable / total params | train-time tau estimate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, kind, dtype, budget, steps, gb, seqs, toks, secs, tps, p, tau in rows:
        ptxt = f"{p[0] / 1e6:.1f}M / {p[1] / 1e6:.1f}M" if p else "?"
        tau_txt = f"{tau:.2f}" if isinstance(tau, (int, float)) else "-"
        lines.append(f"| {name} | {kind} | {dtype} | {budget} | {steps} | {gb} | {seqs} | {toks:.0f} | {secs:.0f} | {tps:.0f} "
                     f"| {ptxt} | {tau_txt} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
