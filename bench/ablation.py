"""Reduced drafter ablations on a 2-core CPU: depth (paper Fig. 3) or block size (paper Fig. 4).

Every drafter of the chosen ablation (the series of ``dspark reproduce --ablations``) is trained on the study's
feature cache for the same wall-clock budget with one thread, then all are evaluated together on a few samples
per benchmark. Writes docs/ablation-<kind>.md and docs/figures/ablation_<kind>.png.

    python bench/ablation.py depth --budget-s 150 --limit 1
    python bench/ablation.py block --budget-s 150 --limit 2

Needs runs/study from ``dspark reproduce --budget cpu --out runs/study`` (tokenized data and the feature cache).
Resumable: finished trainings are kept (``--resume``) and the evaluation resumes per sample.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dspark.evaluation.report import plot_ablation
from dspark.studies.reproduce import LATEST, _ablation_rows, block_series, depth_series

STUDY = Path("runs/study")
KINDS = {
    # kind: (series, x-axis label, figure title, what is held fixed)
    "depth": (lambda layers: depth_series(), "layers", "Drafter depth at block size 7 (Fig. 3)",
              "DSpark (Markov head) with 1-5 draft layers and a 5-layer DFlash, block size 7"),
    "block": (block_series, "draft length (gamma + 1)", "Draft length: Markov / RNN head vs DFlash (Fig. 4)",
              "DSpark (Markov and RNN heads) and DFlash at gamma = 3, 7, 11, 15 (draft lengths 4, 8, 12, 16)"),
}


def _check_same_settings(run: Path, args: argparse.Namespace) -> None:
    """Resuming is for interrupted runs: refuse a folder trained with another budget or dtype."""
    saved = run / "step_latest" / "train_config.json"
    if not saved.is_file():
        return
    cfg = json.loads(saved.read_text(encoding="utf-8"))
    if (cfg.get("time_budget_s"), cfg.get("dtype")) != (args.budget_s, args.dtype):
        raise SystemExit(f"{run} was trained with time_budget_s={cfg.get('time_budget_s')}, dtype={cfg.get('dtype')}; "
                         f"delete {run.parent.parent} to rerun with --budget-s {args.budget_s:g} --dtype {args.dtype}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(KINDS), help="which ablation to run")
    ap.add_argument("--budget-s", type=float, default=150, help="training wall-clock seconds per drafter")
    ap.add_argument("--limit", type=int, default=1, help="evaluation samples per benchmark")
    ap.add_argument("--layers", type=int, default=1, help="draft layers in the block-size ablation")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                    help="training compute dtype (fp32 master weights either way); bf16 trains ~2.4x more tokens "
                    "per second on this CPU (default: %(default)s)")
    ap.add_argument("--study", type=Path, default=STUDY, help="output of `dspark reproduce --budget cpu`")
    ap.add_argument("--dspark", default=str(Path(sys.executable).with_name("dspark")), help="dspark executable")
    args = ap.parse_args(argv)

    make_series, x_label, title, what = KINDS[args.kind]
    series = make_series(args.layers)
    out = args.study / f"ablation-{args.kind}"
    common = ["--set", f"data={args.study / 'tok'}", "--set", "feature_source=cache",
              "--set", f"cache_dir={args.study / 'data' / 'features'}", "--set", "max_length=512",
              "--set", "epochs=10", "--set", "num_threads=1", "--set", f"time_budget_s={args.budget_s:g}", "--set", f"dtype={args.dtype}"]
    drafters: list[str] = []
    for s in series:
        run = out / "train" / s.name
        _check_same_settings(run, args)
        cmd = [args.dspark, "train", "--config", s.preset, "--drafter", s.kind, "--out", str(run), "--resume",
               *common]
        for o in s.overrides:
            cmd += ["--set", o]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        drafters += ["--drafter", f"{s.name}={run / LATEST}"]
    cmd = [args.dspark, "--threads", "1", "eval", "--datasets", "all", "--limit", str(args.limit),
           "--max-new-tokens", str(args.max_new_tokens), "--out", str(out / "eval"), "--no-progress", *drafters]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)

    results = json.loads((out / "eval" / "results.json").read_text(encoding="utf-8"))
    rows = _ablation_rows(results, series)
    fig = Path("docs/figures") / f"ablation_{args.kind}.png"
    plot_ablation(rows, fig, x_label, title)
    table = (out / "eval" / "results.md").read_text(encoding="utf-8").split("\n", 1)[1]
    rerun = f"python bench/ablation.py {args.kind} --budget-s {args.budget_s:g} --limit {args.limit} --dtype {args.dtype}"
    if args.kind == "block":
        rerun += f" --layers {args.layers}"
    budget_rows = ["| Drafter | steps | tokens seen | train tok/s |", "|---|---:|---:|---:|"]
    for s in series:
        summary = json.loads((out / "train" / s.name / "train_summary.json").read_text(encoding="utf-8"))
        budget_rows.append(f"| {s.name} | {summary['steps']} | {summary['tokens_seen']:.0f} | "
                           f"{summary['tokens_per_s']:.0f} |")
    table += "\n## Training budget actually used\n\n" + "\n".join(budget_rows) + "\n"
    doc = Path(f"docs/ablation-{args.kind}.md")
    doc.write_text(
        f"# {title.split(' (')[0]} ablation (reduced)\n\n"
        f"Written by `{rerun}`: {what}, "
        + (f"{args.layers} draft layer(s), " if args.kind == "block" else "")
        + f"each trained for {args.budget_s:g} s ({args.dtype}, one thread) on the study's feature cache "
        "(see study-data.md; tokens seen per drafter below), "
        f"evaluated on {args.limit} sample(s) per benchmark at temperature 1.0. A reduced version of the paper's "
        "figure; see findings.md for how to read it at this budget.\n\n"
        f"![{args.kind} ablation](figures/{fig.name})\n\n" + table, encoding="utf-8")
    print(f"wrote {doc} and {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
