"""Write docs/reference-drafter.md: the shipped reference drafter against its DFlash twin, prompt lookup and hybrid.

Reads the `dspark eval` results of bench/reference_drafter.sh's evaluation step and the two training summaries:

    python bench/reference_report.py --run runs/ref --eval runs/ref-eval [--out docs/reference-drafter.md]

Evaluation folders expected under --eval: t0, t0-hybrid (temperature 0), t1, t1-hybrid (temperature 1), each from
    dspark --threads 1 eval --datasets all --limit 2 --max-new-tokens 128 --temperature T --out EVAL/tT \\
        --drafter dspark=checkpoints/smollm2-135m-dspark --drafter dflash=RUN/dflash/step_S --drafter prompt-lookup=prompt-lookup
    dspark --threads 1 eval ... --out EVAL/tT-hybrid --hybrid --drafter hybrid=checkpoints/smollm2-135m-dspark
Stage 2 (optional): --data-mix and --data-mix-t1 are bench/data_mix.sh's EVAL and EVAL1 folders; their rows are
dspark-stage2 (more regenerated answers) and dspark-label (teacher-forced labelled text), both fine-tuned from stage 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/ref", help="bench/reference_drafter.sh's RUN folder")
    p.add_argument("--eval", default="runs/ref-eval", help="folder of the four evaluations")
    p.add_argument("--eval2", default=None,
                   help="folder of stage 2's evaluations (the same four, drafters dspark-stage2 and hybrid-stage2)")
    p.add_argument("--data-mix", default=None,
                   help="bench/data_mix.sh's EVAL folder (regen/ and label/, greedy): the two stage-2 arms")
    p.add_argument("--data-mix-t1", default=None, help="bench/data_mix.sh's EVAL1 folder (temperature 1)")
    p.add_argument("--out", default="docs/reference-drafter.md")
    args = p.parse_args()
    run, ev = Path(args.run), Path(args.eval)
    names = ("dspark", "dflash", "dspark2", "dspark-label")
    summaries = {k: json.loads((run / k / "train_summary.json").read_text()) for k in names
                 if (run / k / "train_summary.json").is_file()}
    head = ["drafter", "GSM8K", "MATH500", "AIME25", "MBPP", "HumanEval", "LCB", "MT-Bench", "Arena-Hard",
            "Math", "Code", "Chat", "Overall"]
    parts = [
        "# The reference drafter (checkpoints/smollm2-135m-dspark)\n",
        "Written by `python bench/reference_report.py --run runs/ref --eval runs/ref-eval --data-mix "
        "runs/data-mix-eval --data-mix-t1 runs/data-mix-eval-t1` from the runs of `bash bench/reference_drafter.sh` "
        "(data, training, packaging), `bash bench/data_mix.sh` (stage 2) and the evaluations named in this "
        "script's docstring and in bench/data_mix.sh (all 8 sets, 2 prompts each, 128 new tokens, batch 1, every "
        "draft verified, float32, one thread). The shipped drafter is stage 1's `dspark`.\n",
        "## Training (one thread each, bf16 with fp32 master weights)\n",
        "Stage 1: dspark and dflash side by side on the same data (the first 560 prompts' answers) from scratch. "
        "Stage 2 (when run): dspark2 and dspark-label side by side, both from dspark's last checkpoint "
        "(`--init-from`, fresh optimizer and schedule), on stage 1's cache plus the answers to prompts 561-1,200 "
        "(dspark2) or teacher-forced labelled text (dspark-label) (bench/data_mix.sh).\n",
        "\n".join(markdown_table(
            ["drafter", "steps", "tokens seen", "train tok/s", "seconds", "trainer's tau estimate"],
            [[k, str(s["steps"]), f"{s['tokens_seen']:.0f}", fmt(s["tokens_per_s"], 0), fmt(s.get("train_seconds_total"), 0),
              fmt((s.get("final_metrics") or {}).get("tau"))] for k, s in summaries.items()])) + "\n",
    ]
    for temp in ("0", "1"):
        results = {**_drafters(ev / f"t{temp}"), **_drafters(ev / f"t{temp}-hybrid")}
        if args.eval2:
            results.update({**_drafters(Path(args.eval2) / f"t{temp}"), **_drafters(Path(args.eval2) / f"t{temp}-hybrid")})
        mix = {"0": args.data_mix, "1": args.data_mix_t1}[temp]
        if mix:
            mix = Path(mix)
            arm_names = {"regen": "dspark-stage2", "label": "dspark-label"}  # bench/data_mix.sh's drafter names
            results.update({arm_names.get(k, k): d for arm in ("regen", "label") for k, d in _drafters(mix / arm).items()})
        if not results:
            continue
        label = "greedy" if temp == "0" else "temperature 1"
        if temp == "0":
            parts.append("Evaluated checkpoints (DFlash at the step count of DSpark's last checkpoint, rounded down to "
                         "its checkpoint interval: the same data and steps): "
                         + "; ".join(f"{k} = `{d['spec']}`" for k, d in results.items()) + "\n")
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
    Path(args.out).write_text("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
