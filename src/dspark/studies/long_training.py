"""The tables of docs/reports/long-training.md, the last step of ``scripts/long_training.sh``.

The script trains DSpark (Markov head) for BUDGET seconds and DFlash for the same number of optimizer steps on
the study's feature cache, evaluates both next to the study's own DSpark drafter, then calls
``write_long_training_tables`` with the runs it used and how each was trained. What the runs are and how to
read the tables is the page's own text; this module writes only what it reads off the runs, between the
page's markers (``BEGIN``, ``END``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dspark.tables import markdown_table

BEGIN, END = "<!-- scripts/long_training.sh: tables -->", "<!-- /scripts/long_training.sh -->"
FIGURE = "long_training_acceptance_math.png"


def _summary(run: str | Path) -> dict:
    return json.loads((Path(run) / "train_summary.json").read_text())


def long_training_tables(runs: list[tuple[str, str | Path, str]], eval_dir: str | Path) -> str:
    """The training table (one row per (drafter name, run folder, how it was trained)), the math acceptance
    figure and the evaluation tables of ``eval_dir`` (its results.md without the title and the figures it keeps
    beside itself)."""
    rows = []
    for name, run, how in runs:
        s = _summary(run)
        m = s["final_metrics"]
        rows.append([name, how, str(s["steps"]), f"{s['tokens_seen']:.0f}", f"{s['tokens_per_s']:.0f}",
                     " ".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("acc@")), f"{m['tau']:.3f}"])
    table = markdown_table(["drafter", "training", "steps", "tokens seen", "train tok/s",
                            "train acceptance at draft positions 1..7", "train tau"], rows)
    results = (Path(eval_dir) / "results.md").read_text().split("\n", 1)[1].split("\n## Figures\n", 1)[0]
    return ("\n".join(table) + "\n\n" + f"![per-position acceptance, math](figures/{FIGURE})\n\n"
            + results.strip("\n") + "\n")


def write_long_training_tables(page: str | Path, runs: list[tuple[str, str | Path, str]],
                               eval_dir: str | Path) -> Path:
    """Replace what lies between ``BEGIN`` and ``END`` in ``page`` with ``long_training_tables`` and copy the
    math acceptance figure into the page's figures/ folder. A page without the markers is a ``ValueError``:
    its text says what the tables are, so it is never written from scratch."""
    page, eval_dir = Path(page), Path(eval_dir)
    text = page.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text.split(BEGIN, 1)[1]:
        raise ValueError(f"{page}: no {BEGIN} ... {END} markers to write the tables between")
    head, rest = text.split(BEGIN, 1)
    body = long_training_tables(runs, eval_dir)
    (page.parent / "figures").mkdir(parents=True, exist_ok=True)
    shutil.copy(eval_dir / "acceptance_math.png", page.parent / "figures" / FIGURE)
    page.write_text(head + BEGIN + "\n" + body + END + rest.split(END, 1)[1], encoding="utf-8")
    return page
