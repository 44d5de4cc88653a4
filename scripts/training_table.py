"""Write docs/training.md's budget table from the training runs of a study.

    python scripts/training_table.py --runs runs/study/train --out docs/reports/training-runs.md

Reads each run's train_summary.json and train_config.json (written by `dspark train`) and reports the
budget (wall-clock cap, steps, sequences, tokens) and the measured training throughput
(``dspark.studies.training_runs``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.studies.training_runs import training_runs_markdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=["runs/study/train"],
                    help="folders with one sub-folder per training run")
    ap.add_argument("--out", default="docs/reports/training-runs.md")
    args = ap.parse_args()
    text = training_runs_markdown(args.runs, f"python scripts/training_table.py --runs {' '.join(args.runs)} "
                                             f"--out {args.out}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
