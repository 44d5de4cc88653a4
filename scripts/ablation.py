"""Reduced drafter ablations on a 2-core CPU: depth (paper Fig. 3) or block size (paper Fig. 4).

Every drafter of the chosen ablation (the series of ``dspark reproduce --ablations``) is trained on the study's
feature cache for the same wall-clock budget with one thread, then all are evaluated together on a few samples
per benchmark. Writes docs/reports/ablation-<kind>.md and docs/reports/figures/ablation_<kind>.png.

    python scripts/ablation.py depth --budget-s 150 --limit 1
    python scripts/ablation.py block --budget-s 150 --limit 2

Needs runs/study from ``dspark reproduce --budget cpu --out runs/study`` (tokenized data and the feature cache).
Resumable: finished trainings are kept (``--resume``) and the evaluation resumes per sample.
The study itself is ``dspark.studies.ablations``; this script only reads the flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspark.errors import DSparkError
from dspark.studies.ablations import KINDS, ReducedAblation, run_reduced_ablation


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
    ap.add_argument("--study", type=Path, default=Path("runs/study"), help="output of `dspark reproduce --budget cpu`")
    ap.add_argument("--dspark", default=str(Path(sys.executable).with_name("dspark")), help="dspark executable")
    args = ap.parse_args(argv)
    cfg = ReducedAblation(args.kind, args.budget_s, args.limit, args.layers, args.max_new_tokens, args.dtype,
                          args.study, args.dspark)
    try:
        doc, fig = run_reduced_ablation(cfg)
    except DSparkError as err:
        raise SystemExit(str(err)) from None
    print(f"wrote {doc} and {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
