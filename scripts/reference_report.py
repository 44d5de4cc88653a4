"""Write docs/results.md: the shipped reference drafter against its DFlash twin, prompt lookup and hybrid.

Reads the `dspark eval` and `dspark calibrate` results and the training summaries; scripts/reference_eval.sh runs
them all (each command is there) and then this script:

    python scripts/reference_report.py --run runs/ref --eval runs/ref-eval [--out docs/results.md]

--eval holds t0, t0-hybrid (temperature 0), t1, t1-hybrid (temperature 1) and t1-sts (temperature 1 with the STS
temperatures of --calibration applied); t0-hybrid-static and t1-hybrid-static, where present, are the hybrid's
evaluations from before its adaptive choice on short n-gram matches (rows hybrid-static). Stage 2 (optional): --data-mix and --data-mix-t1 are scripts/data_mix.sh's
EVAL and EVAL1 folders; their rows are dspark-stage2 (more regenerated answers) and dspark-label (teacher-forced
labelled text), both fine-tuned from stage 1.
The per-position curves and the reliability diagram are copied to docs/figures/reference/.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dspark.evaluation.report import confidence_rows
from dspark.tables import fmt, markdown_table

BENCHES = ("gsm8k", "math500", "aime25", "mbpp", "humaneval", "livecodebench", "mt-bench", "arena-hard-v2")
DOMAINS = ("math", "code", "chat")


def _drafters(folder: Path) -> dict:
    path = folder / "results.json"
    return json.loads(path.read_text())["drafters"] if path.is_file() else {}


def _tau_table(results: dict) -> list[list[str]]:
    rows = []
    for name, d in results.items():
        bench = [fmt(d["benchmarks"].get(b, {}).get("acceptance_length")) for b in BENCHES]
        dom = [fmt(d["domains"].get(x, {}).get("acceptance_length")) for x in DOMAINS]
        rows.append([name, *bench, *dom, fmt(d["overall"]["acceptance_length"])])
    return rows


def _curve_table(results: dict) -> list[list[str]]:
    rows = []
    for name, d in results.items():
        for dom in DOMAINS:
            curve = d["domains"].get(dom, {}).get("per_position_acceptance") or []
            rows.append([name, dom, *[fmt(x) for x in curve]])
    return rows


def _calibration_parts(calib: Path | None, sts_eval: Path | None, figures: Path, out: Path) -> list[str]:
    """The confidence head: STS fitted on held-out rows (before/after), then raw vs STS on the evaluation sets."""
    parts: list[str] = []
    report = json.loads((calib / "calibration.json").read_text()) if calib and (calib / "calibration.json").is_file() else None
    if report:
        b, a = report["before"], report["after"]
        parts += [
            "## Calibration of the confidence head (paper Fig. 6)\n",
            f"STS (one temperature per draft position) fitted on {report['num_prompts']} held-out prompts "
            f"({report['heldout']}; {report['num_steps']} speculative steps at temperature {report['temperature']:g}, "
            f"{report['max_new_tokens']} new tokens), disjoint from the evaluated rows. Temperatures: "
            + ", ".join(f"{t:.3g}" for t in report["temperatures"]) + ". The confidence predicts the cumulative "
            "survival 'drafts 1..k all accepted'; ECE over "
            f"{report['n_bins']} equal-width bins, count-weighted over positions.\n",
            "\n".join(markdown_table(["held-out", "ECE", "AUROC", "Brier"], [
                ["before STS (raw)", fmt(b["ece_mean"], 4), fmt(b["auc_mean"], 3), fmt(b["brier_mean"], 4)],
                ["after STS", fmt(a["ece_mean"], 4), fmt(a["auc_mean"], 3), fmt(a["brier_mean"], 4)]])) + "\n",
            "Per position (held-out, ECE raw -> STS): " + ", ".join(
                f"k={pb['position'] + 1} {fmt(pb['ece'], 3)} -> {fmt(pa['ece'], 3)}"
                for pb, pa in zip(b.get("per_position", []), a.get("per_position", []))) + "\n",
        ]
        if (calib / "reliability.png").is_file():
            shutil.copy(calib / "reliability.png", figures / "reliability.png")
            parts.append(f"![reliability]({(figures / 'reliability.png').relative_to(out.parent)})\n")
    if sts_eval and (sts_eval / "results.json").is_file():
        results = json.loads((sts_eval / "results.json").read_text())
        parts += ["On the evaluation sets (temperature 1, the rows of the tables above), raw against STS:\n",
                  "\n".join(markdown_table(["drafter", "benchmark", "ECE", "AUROC", "Brier", "predictions"],
                                           confidence_rows(results))) + "\n"]
    return parts


def _copy_curves(ev: Path, figures: Path, out: Path) -> list[str]:
    """Per-position acceptance figures of the stage-1 evaluations, copied beside the page."""
    lines = []
    for temp in ("0", "1"):
        pngs = sorted((ev / f"t{temp}").glob("acceptance_*.png"))
        for png in pngs:
            dest = figures / f"t{temp}-{png.name}"
            shutil.copy(png, dest)
            lines.append(f"![{dest.stem}]({dest.relative_to(out.parent)})")
    return (["## Per-position acceptance curves (paper Fig. 2)\n", "Greedy (t0) and temperature 1 (t1), per "
             "domain, from the stage-1 evaluations:\n", "\n".join(lines) + "\n"] if lines else [])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/ref", help="scripts/reference_drafter.sh's RUN folder")
    p.add_argument("--eval", default="runs/ref-eval", help="folder of the four evaluations")
    p.add_argument("--eval2", default=None,
                   help="folder of stage 2's evaluations (the same four, drafters dspark-stage2 and hybrid-stage2)")
    p.add_argument("--data-mix", default=None,
                   help="scripts/data_mix.sh's EVAL folder (regen/ and label/, greedy): the two stage-2 arms")
    p.add_argument("--data-mix-t1", default=None, help="scripts/data_mix.sh's EVAL1 folder (temperature 1)")
    p.add_argument("--calibration", default=None, help="`dspark calibrate --out` folder of the reference drafter")
    p.add_argument("--sts-eval", default=None, help="temperature-1 evaluation with --sts (see the docstring)")
    p.add_argument("--out", default="docs/results.md")
    args = p.parse_args()
    out = Path(args.out)
    figures = out.parent / "figures" / "reference"
    figures.mkdir(parents=True, exist_ok=True)
    run, ev = Path(args.run), Path(args.eval)
    names = ("dspark", "dflash", "dspark2", "dspark-label")
    summaries = {k: json.loads((run / k / "train_summary.json").read_text()) for k in names
                 if (run / k / "train_summary.json").is_file()}
    head = ["drafter", "GSM8K", "MATH500", "AIME25", "MBPP", "HumanEval", "LCB", "MT-Bench", "Arena-Hard",
            "Math", "Code", "Chat", "Overall"]
    parts = [
        "# Results: the reference drafter (checkpoints/smollm2-135m-dspark)\n",
        "Paper Table 1 (acceptance length at temperature 0 and 1), the per-position curves and the confidence "
        "head's calibration, for the shipped DSpark drafter and DFlash trained beside it on the same data and "
        "steps. Written by `python scripts/reference_report.py --run runs/ref --eval runs/ref-eval --data-mix "
        "runs/data-mix-eval --data-mix-t1 runs/data-mix-eval-t1 --calibration runs/ref-calib --sts-eval "
        "runs/ref-eval/t1-sts` (the last step of `bash scripts/reference_eval.sh`) from the runs of `bash "
        "scripts/reference_drafter.sh` (data, training, packaging), `bash scripts/data_mix.sh` (stage 2) and the "
        "evaluations of scripts/reference_eval.sh and scripts/data_mix.sh (all 8 sets, 2 prompts each, 128 new "
        "tokens, batch 1, every "
        "draft verified, float32, one thread). The shipped drafter is stage 1's `dspark`. The older study of all "
        "four drafters at minutes of training each (`dspark reproduce`) is [reports/results-study.md](reports/results-study.md).\n",
        "## Training (one thread each, bf16 with fp32 master weights)\n",
        "Stage 1: dspark and dflash side by side on the same data (the first 560 prompts' answers) from scratch. "
        "Stage 2 (when run): dspark2 and dspark-label side by side, both from dspark's last checkpoint "
        "(`--init-from`, fresh optimizer and schedule), on stage 1's cache plus the answers to prompts 561-1,200 "
        "(dspark2) or teacher-forced labelled text (dspark-label) (scripts/data_mix.sh).\n",
        "\n".join(markdown_table(
            ["drafter", "steps", "tokens seen", "train tok/s", "seconds", "trainer's tau estimate"],
            [[k, str(s["steps"]), f"{s['tokens_seen']:.0f}", fmt(s["tokens_per_s"], 0), fmt(s.get("train_seconds_total"), 0),
              fmt((s.get("final_metrics") or {}).get("tau"))] for k, s in summaries.items()])) + "\n",
    ]
    for temp in ("0", "1"):
        results = {**_drafters(ev / f"t{temp}"), **_drafters(ev / f"t{temp}-hybrid")}
        # the hybrid before its adaptive choice on short matches (evaluated before that change, kept for comparison)
        results.update({f"{k}-static": d for k, d in _drafters(ev / f"t{temp}-hybrid-static").items()})
        if args.eval2:
            results.update({**_drafters(Path(args.eval2) / f"t{temp}"), **_drafters(Path(args.eval2) / f"t{temp}-hybrid")})
        mix = {"0": args.data_mix, "1": args.data_mix_t1}[temp]
        if mix:
            mix = Path(mix)
            arm_names = {"regen": "dspark-stage2", "label": "dspark-label"}  # scripts/data_mix.sh's drafter names
            results.update({arm_names.get(k, k): d for arm in ("regen", "label") for k, d in _drafters(mix / arm).items()})
        if not results:
            continue
        label = "greedy" if temp == "0" else "temperature 1"
        if temp == "0":
            parts.append("Evaluated checkpoints (DFlash at the step count of DSpark's last checkpoint, rounded down to "
                         "its checkpoint interval: the same data and steps): "
                         + "; ".join(f"{k} = `{d['spec']}`" for k, d in results.items()) + ". hybrid = `--hybrid` "
                         "(prompt lookup on 3-gram repeats, on shorter repeats while their running acceptance pays "
                         "more than DSpark's, else DSpark); hybrid-static = the same before that adaptive choice "
                         "(prompt lookup on 3-gram repeats only).\n")
        parts += [f"## Acceptance length tau, {label} (bonus token included)\n",
                  "\n".join(markdown_table(head, _tau_table(results))) + "\n",
                  f"Per-position conditional acceptance, {label} (P(draft k accepted | drafts < k accepted)):\n",
                  "\n".join(markdown_table(["drafter", "domain", *[f"k={k}" for k in range(1, 8)]],
                                           _curve_table(results))) + "\n"]
    overall = {}
    for temp, folders in (("0", (ev / "t0", args.data_mix)), ("1", (ev / "t1", args.data_mix_t1))):
        found = dict(_drafters(folders[0]))
        if folders[1]:
            for arm, name in (("regen", "dspark-stage2"), ("label", "dspark-label")):
                found.update({name: d for d in _drafters(Path(folders[1]) / arm).values()})
        overall[temp] = {k: d["overall"]["acceptance_length"] for k, d in found.items()}
    if all("dspark-stage2" in o for o in overall.values()):
        line = "; ".join(
            f"{'greedy' if t == '0' else 'temperature 1'}: stage 1 {o['dspark']:.2f}, regenerated {o['dspark-stage2']:.2f}"
            f" ({o['dspark-stage2'] - o['dspark']:+.2f}), labelled {o['dspark-label']:.2f}"
            f" ({o['dspark-label'] - o['dspark']:+.2f})" for t, o in overall.items())
        parts += ["## Stage 2\n",
                  f"Overall tau after stage 2 against stage 1 ({line}). Each evaluation decodes 16 prompts of "
                  "128 tokens; differences of a few hundredths are within what another set of prompts would "
                  "move. Neither arm is measurably better than stage 1, so the shipped drafter stays stage 1's; "
                  "what each arm's data cost is in [data-throughput.md §Which data per CPU-hour]"
                  "(data-throughput.md#which-data-per-cpu-hour).\n"]
    parts += _copy_curves(ev, figures, out)
    parts += _calibration_parts(Path(args.calibration) if args.calibration else None,
                                Path(args.sts_eval) if args.sts_eval else None, figures, out)
    out.write_text("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
