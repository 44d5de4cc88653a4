"""Write docs/reference-drafter.md: the shipped reference drafter against its DFlash twin, prompt lookup and hybrid.

Reads the `dspark eval` results of bench/reference_drafter.sh's evaluation step and the two training summaries:

    python bench/reference_report.py --run runs/ref --eval runs/ref-eval [--out docs/reference-drafter.md]

Evaluation folders expected under --eval: t0, t0-hybrid (temperature 0), t1, t1-hybrid (temperature 1), each from
    dspark --threads 1 eval --datasets all --limit 2 --max-new-tokens 128 --temperature T --out EVAL/tT \\
        --drafter dspark=checkpoints/smollm2-135m-dspark --drafter dflash=RUN/dflash/step_S --drafter prompt-lookup=prompt-lookup
    dspark --threads 1 eval ... --out EVAL/tT-hybrid --hybrid --drafter hybrid=checkpoints/smollm2-135m-dspark
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
    p.add_argument("--out", default="docs/reference-drafter.md")
    args = p.parse_args()
    run, ev = Path(args.run), Path(args.eval)
    summaries = {k: json.loads((run / k / "train_summary.json").read_text()) for k in ("dspark", "dflash")}
    head = ["drafter", "GSM8K", "MATH500", "AIME25", "MBPP", "HumanEval", "LCB", "MT-Bench", "Arena-Hard",
            "Math", "Code", "Chat", "Overall"]
    parts = [
        "# The reference drafter (checkpoints/smollm2-135m-dspark)\n",
        "Written by `python bench/reference_report.py --run runs/ref --eval runs/ref-eval` from the runs of "
        "`bash bench/reference_drafter.sh` (data, training, packaging) and the evaluations named in that "
        "script's docstring (all 8 sets, 2 prompts each, 128 new tokens, batch 1, every draft verified, "
        "float32, one thread).\n",
        "## Training (same data, side by side, one thread each, bf16 with fp32 master weights)\n",
        "\n".join(markdown_table(
            ["drafter", "steps", "tokens seen", "train tok/s", "seconds", "trainer's tau estimate"],
            [[k, str(s["steps"]), f"{s['tokens_seen']:.0f}", fmt(s["tokens_per_s"], 0), fmt(s.get("train_seconds_total"), 0),
              fmt((s.get("final_metrics") or {}).get("tau"))] for k, s in summaries.items()])) + "\n",
    ]
    for temp in ("0", "1"):
        results = {**_drafters(ev / f"t{temp}"), **_drafters(ev / f"t{temp}-hybrid")}
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
    Path(args.out).write_text("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
