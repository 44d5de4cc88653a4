"""Write docs/reports/results.md: a candidate reference drafter against the shipped one, its DFlash twin, prompt lookup
and hybrid drafting (paper Table 1 at temperature 0 and 1, per-position curves, calibration).

Reads the `dspark eval` / `dspark calibrate` folders and the training summaries; scripts/reference_eval.sh runs
every command and then this script:

    python scripts/reference_report.py --eval runs/scale/ref-eval --calibration runs/scale/ref-calib \
        --sts-eval runs/scale/ref-eval/t1-sts --train dspark=runs/scale/train/dspark-all [--out docs/reports/results.md]

--eval holds t0 and t1 (the drafters side by side, the candidate `dspark` first: every paired difference is
against it) and t0-hybrid, t1-hybrid (hybrid drafting with the candidate and with the shipped drafter).
The per-position curves and the reliability diagram are copied to docs/reports/figures/reference/ (--figures
names another folder there, for a second page such as the equal-data Table 1 with Eagle3).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dspark.evaluation.report import comparison_table, confidence_rows, tau_table
from dspark.tables import fmt, markdown_table
from dspark.training.trainer import recent_mean


#: the equal-data Table 1 (scripts/reference_eval.sh with OUT=docs/reports/results-equal-data.md): results.md links it
EQUAL_DATA_PAGE = "results-equal-data.md"


def _results(folder: Path) -> dict | None:
    path = folder / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _merged(ev: Path, temp: str) -> dict | None:
    """The drafters of t{temp} and t{temp}-hybrid in one results dict (the same prompts and seeds)."""
    base, hybrid = _results(ev / f"t{temp}"), _results(ev / f"t{temp}-hybrid")
    if base is None:
        return hybrid
    if hybrid is not None:
        base["drafters"].update(hybrid["drafters"])
        base["comparisons"] = [*(base.get("comparisons") or []), *(hybrid.get("comparisons") or [])]
    return base


def _curve_table(results: dict) -> list[str]:
    rows = []
    for name, d in results["drafters"].items():
        for dom, summary in d["domains"].items():
            rows.append([name, dom, *[fmt(x) for x in summary.get("per_position_acceptance") or []]])
    return markdown_table(["drafter", "domain", *[f"k={k}" for k in range(1, 8)]], rows)


def _training(train: list[str]) -> list[str]:
    rows = []
    for spec in train:
        name, _, folder = spec.partition("=")
        path = Path(folder) / "train_summary.json"
        if not path.is_file():
            continue
        s = json.loads(path.read_text())
        rows.append([name, f"`{folder}`", str(s["steps"]), f"{s['tokens_seen'] / 1e6:.2f} M", str(s.get("world_size", 1)),
                     fmt(s["tokens_per_s"], 0), fmt(s.get("train_seconds_total"), 0),
                     fmt(recent_mean(folder, "tau")), fmt(recent_mean(folder, "acc@0"))])
    return markdown_table(["drafter", "run", "steps", "tokens seen", "processes", "train tok/s", "seconds",
                           "trainer's tau estimate (last 100 logged steps)", "its first-position accuracy"],
                          rows) if rows else []


def _calibration(calib: Path | None, sts_eval: Path | None, figures: Path, out: Path) -> list[str]:
    parts: list[str] = []
    report = _results_file(calib, "calibration.json")
    if report:
        b, a = report["before"], report["after"]
        parts += [
            "## Calibration of the confidence head (paper Fig. 6)\n",
            f"STS (one temperature per draft position) fitted on {report['num_prompts']} held-out prompts "
            f"({report['heldout']}; {report['num_steps']} speculative steps at temperature {report['temperature']:g}, "
            f"{report['max_new_tokens']} new tokens), disjoint from the evaluated rows. Temperatures: "
            + ", ".join(f"{t:.3g}" for t in report["temperatures"]) + ". The confidence predicts the cumulative "
            f"survival 'drafts 1..k all accepted'; ECE over {report['n_bins']} equal-width bins, count-weighted "
            "over positions.\n",
            "\n".join(markdown_table(["held-out", "ECE", "AUROC", "Brier"], [
                ["before STS (raw)", fmt(b["ece_mean"], 4), fmt(b["auc_mean"], 3), fmt(b["brier_mean"], 4)],
                ["after STS", fmt(a["ece_mean"], 4), fmt(a["auc_mean"], 3), fmt(a["brier_mean"], 4)]])) + "\n",
        ]
        if (calib / "reliability.png").is_file():
            shutil.copy(calib / "reliability.png", figures / "reliability.png")
            parts.append(f"![reliability]({(figures / 'reliability.png').relative_to(out.parent)})\n")
    results = _results(sts_eval) if sts_eval else None
    if results:
        parts += ["On the evaluation sets (temperature 1), raw against STS:\n",
                  "\n".join(markdown_table(["drafter", "benchmark", "ECE", "AUROC", "Brier", "predictions"],
                                           confidence_rows(results))) + "\n"]
    return parts


def _results_file(folder: Path | None, name: str) -> dict | None:
    return json.loads((folder / name).read_text()) if folder and (folder / name).is_file() else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eval", default="runs/scale/ref-eval", help="folder of the evaluations (t0, t1, t*-hybrid)")
    p.add_argument("--train", action="append", default=[], metavar="NAME=DIR",
                   help="a training run whose train_summary.json is tabled; repeatable")
    p.add_argument("--calibration", default=None, help="`dspark calibrate --out` folder of the candidate")
    p.add_argument("--sts-eval", default=None, help="temperature-1 evaluation with --sts")
    p.add_argument("--out", default="docs/reports/results.md")
    p.add_argument("--command", default="bash scripts/reference_eval.sh",
                   help="the command that ran the evaluations, for the page (reference_eval.sh passes its own)")
    p.add_argument("--title", default="Results: the reference drafter against its peers", help="the page's title")
    p.add_argument("--figures", default="reference",
                   help="folder under the page's figures/ that receives its plots (default: reference)")
    args = p.parse_args()
    out, ev = Path(args.out), Path(args.eval)
    figures = out.parent / "figures" / args.figures
    figures.mkdir(parents=True, exist_ok=True)
    parts = [
        f"# {args.title}\n",
        "Paper Table 1 (acceptance length at temperature 0 and 1), the per-position curves and the confidence "
        "head's calibration. Rerun: `" + args.command + "` (it runs every evaluation, then "
        "`python scripts/reference_report.py` with its folders). Rows: the first (`dspark`, or `dspark-N` for a point of the scaling curve) = the candidate reference drafter "
        "(docs/reports/training-scale.md), `shipped` = the checkpoint in checkpoints/smollm2-135m-dspark when the "
        "evaluation ran, `dflash` (`dflash-N`) = DFlash trained beside the candidate on the same data and steps, "
        "`eagle3` (`eagle3-eq`) = Eagle3 trained beside it on the same data, steps and draft vocabulary (one layer, "
        "7-step training-time test; only where the run names one), `prompt-lookup`, and `hybrid` / `hybrid-shipped` "
        "= `--hybrid` (prompt lookup on repeats, the trained drafter elsewhere) with the candidate / the shipped "
        "drafter. Brackets: 95 % bootstrap intervals over "
        "prompts (redrawn within each benchmark); paired differences use the same prompt draws for both rows.\n",
    ]
    beside = out.parent / EQUAL_DATA_PAGE
    if out.name != EQUAL_DATA_PAGE and beside.is_file():
        parts.append("DFlash and Eagle3 trained from scratch beside a DSpark on the same data and steps (Table 1's "
                     f"three trained rows at one point): [{EQUAL_DATA_PAGE}]({EQUAL_DATA_PAGE}).\n")
    table = _training(args.train)
    if table:
        parts += ["## Training\n", "\n".join(table) + "\n"]
    for temp in ("0", "1"):
        results = _merged(ev, temp)
        if results is None:
            continue
        s = results["settings"]
        counts = sorted({d["num_samples"] for d in results["datasets"]})
        label = "greedy" if temp == "0" else "temperature 1"
        parts += [f"## Acceptance length tau, {label} (bonus token included)\n",
                  f"{len(results['datasets'])} benchmarks, {'/'.join(map(str, counts))} prompts each, at most "
                  f"{s['max_new_tokens']} new tokens, seed {s['seed']}, batch size {s['batch_size']}, every draft "
                  "verified. Checkpoints: " + "; ".join(f"{k} = `{d['spec']}`" for k, d in results["drafters"].items())
                  + ".\n",
                  "\n".join(tau_table(results)) + "\n"]
        comparisons = comparison_table(results)
        if comparisons:
            parts += ["Paired differences (a row is better than its baseline only when the overall interval lies "
                      "above 0):\n", "\n".join(comparisons) + "\n"]
        parts += [f"Per-position conditional acceptance, {label} (P(draft k accepted | drafts < k accepted), "
                  "domain macro):\n", "\n".join(_curve_table(results)) + "\n"]
        pngs = sorted((ev / f"t{temp}").glob("acceptance_*.png"))
        for png in pngs:
            dest = figures / f"t{temp}-{png.name}"
            shutil.copy(png, dest)
        if pngs:
            parts.append(" ".join(f"![t{temp}-{png.stem}]({(figures / f't{temp}-{png.name}').relative_to(out.parent)})"
                                  for png in pngs) + "\n")
    parts += _calibration(Path(args.calibration) if args.calibration else None,
                          Path(args.sts_eval) if args.sts_eval else None, figures, out)
    out.write_text("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
