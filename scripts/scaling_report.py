"""The scaling curve of docs/reports/training-scale.md: tau against supervised training tokens, DSpark and DFlash.

Reads the greedy evaluation that ``scripts/scaling_curve.sh`` writes (one ``dspark eval`` folder holding every
``dspark-N`` and ``dflash-N`` drafter of ``scripts/scale_train.sh``), the tokenized set the points are prefixes
of (for their supervised-token counts) and each run's ``train_summary.json``; writes the table (tau overall and
per domain with 95 % bootstrap intervals over prompts, DSpark - DFlash with a paired interval, the late
positions' conditional acceptance) into the page and the figure next to it.

    .venv/bin/python scripts/scaling_report.py --eval runs/scale/eval-greedy --tok runs/scale/tok-label-1k \
        --train runs/scale/train --out docs/reports/training-scale.md --figure docs/reports/figures/scaling.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from dspark.data.eval_sets import load_eval_dataset
from dspark.data.tokenized import TokenizedDataset
from dspark.evaluation.runner import EvalSettings, aggregate, read_records
from dspark.tables import fmt, markdown_table

BEGIN, END = "<!-- scaling:begin -->", "<!-- scaling:end -->"


def supervised_tokens(tok: Path, n: int | None) -> int:
    data = TokenizedDataset(tok)
    end = int(data.offsets[len(data) if n is None else min(n, len(data))])
    mask = np.load(tok / "loss_mask.npy", mmap_mode="r")
    return int(np.count_nonzero(mask[:end]))


def points(records: list[dict]) -> list[str]:
    """Points with both drafters evaluated, smallest first ('all' last)."""
    names = {r["drafter"] for r in records}
    found = {m.group(2) for n in names if (m := re.fullmatch(r"(dspark|dflash)-(\w+)", n))}
    both = [p for p in found if f"dspark-{p}" in names and f"dflash-{p}" in names]
    return sorted(both, key=lambda p: float("inf") if p == "all" else int(p))


def ci_cell(summary: dict) -> str:
    ci = summary.get("acceptance_length_ci")
    value = fmt(summary.get("acceptance_length"))
    return f"{value} [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else value


def _first_positions(res: dict, k: int = 3) -> str:
    """Conditional acceptance at draft positions 1..k (domain mean): the paper says the sequential head's gain
    is at the later positions; past k = 3 too few steps reach a position to tell at these sizes."""
    return " / ".join(fmt(x) for x in _pooled_curve(res)["per_position_acceptance"][:k])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", type=Path, action="append", default=None,
                    help="a greedy `dspark eval` folder; repeatable: their samples are pooled (the same temperature, "
                    "token budget and seed; default runs/scale/eval-greedy)")
    ap.add_argument("--tok", type=Path, default=Path("runs/scale/tok-label-1k"))
    ap.add_argument("--train", type=Path, default=Path("runs/scale/train"))
    ap.add_argument("--out", type=Path, default=Path("docs/reports/training-scale.md"))
    ap.add_argument("--figure", type=Path, default=Path("docs/reports/figures/scaling.png"))
    args = ap.parse_args(argv)

    evals = args.eval or [Path("runs/scale/eval-greedy")]
    s = json.loads((evals[0] / "run.json").read_text())["settings"]
    records, seen = [], set()
    for folder in evals:
        other = json.loads((folder / "run.json").read_text())["settings"]
        clash = [k for k in ("temperature", "max_new_tokens", "seed", "target") if other.get(k) != s.get(k)]
        if clash:
            print(f"{folder}: {', '.join(f'{k} {other.get(k)!r}' for k in clash)} differ from {evals[0]}'s "
                  f"({', '.join(repr(s.get(k)) for k in clash)}): its samples cannot be pooled", file=sys.stderr)
            return 1
        for r in read_records(folder / "samples.jsonl"):
            key = (r["drafter"], r["dataset"], r["idx"])
            if key not in seen:
                seen.add(key)
                records.append(r)
    found = points(records)
    if not found:
        print(f"{', '.join(map(str, evals))}: no point has both drafters evaluated yet", file=sys.stderr)
        return 1
    limit = max(int(r["idx"]) for r in records) + 1
    datasets = [load_eval_dataset(name, None, limit, s["seed"]) for name in sorted({r["dataset"] for r in records})]
    datasets = [d for d in datasets if len(d)]
    names = [f"{k}-{p}" for p in found for k in ("dspark", "dflash")]
    settings = EvalSettings(**{k: s[k] for k in EvalSettings.__dataclass_fields__ if k in s})
    results = aggregate(records, names, datasets, settings)
    diffs = {(c["drafter"], c["baseline"]): c for c in results["comparisons"]}
    domains = list(results["domains"])

    rows, xs = [], []
    for p in found:
        n = None if p == "all" else int(p)
        sup = supervised_tokens(args.tok, n)
        xs.append(sup)
        ds, df = results["drafters"][f"dspark-{p}"], results["drafters"][f"dflash-{p}"]
        diff = diffs[(f"dflash-{p}", f"dspark-{p}")]  # dflash - dspark: flip the sign
        lo, hi = diff["overall"]["interval"]
        steps = []
        for k in ("dspark", "dflash"):
            summary = args.train / f"{k}-{p}" / "train_summary.json"
            steps.append(json.loads(summary.read_text())["steps"] if summary.is_file() else None)
        ratio = ds["overall"]["acceptance_length"] / df["overall"]["acceptance_length"]
        rows.append([p if p == "all" else f"first {p}", f"{sup / 1e6:.2f} M", str(steps[0]),
                     ci_cell(ds["overall"]), ci_cell(df["overall"]),
                     f"{-diff['overall']['difference']:+.2f} [{-hi:+.2f}, {-lo:+.2f}]", f"{ratio:.3f}x",
                     *(f"{fmt(ds['domains'][d]['acceptance_length'])} / {fmt(df['domains'][d]['acceptance_length'])}"
                       for d in domains),
                     _first_positions(ds), _first_positions(df)])
    header = ["sequences", "supervised tokens", "steps", "DSpark tau", "DFlash tau", "DSpark - DFlash",
              "DSpark / DFlash", *(f"{d} (DSpark / DFlash)" for d in domains), "k = 1, 2, 3 DSpark", "k = 1, 2, 3 DFlash"]
    table = markdown_table(header, rows)
    figure = plot(found, xs, results, args.figure)
    block = [BEGIN, "", f"Greedy (temperature {s['temperature']}), {limit} prompts per benchmark "
             f"({sum(len(d) for d in datasets)} in all), at most {s['max_new_tokens']} new tokens, block size 7. "
             "Brackets: 95 % bootstrap intervals over prompts; DSpark - DFlash is paired (the same prompt draws "
             "for both).", "", *table, "", f"![scaling]({Path('figures') / args.figure.name})", "", END]
    page = args.out.read_text() if args.out.is_file() else f"# Training at scale\n\n{BEGIN}\n{END}\n"
    if BEGIN not in page:
        page += f"\n{BEGIN}\n{END}\n"
    head, rest = page.split(BEGIN, 1)
    page = head + "\n".join(block) + rest.split(END, 1)[1]
    args.out.write_text(page)
    print("\n".join(table))
    print(f"wrote {args.out} and {figure}")
    return 0


def _pooled_curve(res: dict) -> dict:
    """Position-wise mean of the domain curves (each domain weighs the same, as the overall tau)."""
    curves = [d["per_position_acceptance"] for d in res["domains"].values()]
    width = max(len(c) for c in curves)
    values = [[c[k] for c in curves if k < len(c) and c[k] is not None] for k in range(width)]
    return {"per_position_acceptance": [float(np.mean(v)) if v else None for v in values]}


def plot(found: list[str], xs: list[int], results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, label in (("dspark", "DSpark (Markov head)"), ("dflash", "DFlash")):
        ys = [results["drafters"][f"{kind}-{p}"]["overall"] for p in found]
        mid = [y["acceptance_length"] for y in ys]
        lo = [y["acceptance_length_ci"][0] for y in ys]
        hi = [y["acceptance_length_ci"][1] for y in ys]
        err = [[m - a for m, a in zip(mid, lo)], [b - m for m, b in zip(mid, hi)]]
        ax.errorbar(xs, mid, yerr=err, marker="o", capsize=4, label=f"{label} (95 % interval)")
    ax.set_xscale("log")
    ax.set_xlabel("supervised training tokens (3 passes each)")
    ax.set_ylabel("acceptance length tau (greedy, overall)")
    ax.set_title("SmolLM2-135M drafters: tau against training data")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
