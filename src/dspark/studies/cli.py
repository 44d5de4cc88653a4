"""The study commands: `dspark reproduce` (the whole offline study) and `dspark demo` (the README's command).

``dspark.cli`` registers both with ``add_reproduce`` and ``add_demo``.
"""

from __future__ import annotations

import argparse

from dspark.cli_options import add_drafter_options, add_target_options
from dspark.scheduler.adapter import POLICY_HELP
from dspark.studies import reproduce
from dspark.studies.demo import run_demo
from dspark.target.presets import DEFAULT_TARGET


def add_reproduce(sub: argparse._SubParsersAction) -> None:
    budgets = reproduce.BUDGETS
    p = sub.add_parser(
        "reproduce", help="run the whole study (data, training, calibration, evaluation, figures, docs/reports/results-study.md)",
        description=reproduce.__doc__.split("\n\n")[0] + "\n\nResumable: finished steps are skipped. Budgets: "
        + "; ".join(f"{b.name}: {b.num_prompts} prompts, {b.train_time_s:g}s per drafter, eval limit "
                    f"{b.eval_limit or 'caps'}" for b in budgets.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--budget", choices=list(budgets), default=reproduce.DEFAULT_BUDGET,
                   help="(default: %(default)s)")
    p.add_argument("--out", default="runs/reproduce", help="working folder (default: %(default)s)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target preset or HF folder (default: %(default)s)")
    p.add_argument("--ablations", action="store_true", help="also the depth (Fig. 3) and block-size (Fig. 4) ablations")
    p.add_argument("--data", default=None, metavar="TOKDIR",
                   help="use this tokenized dataset (dspark data tokenize) instead of building one")
    p.add_argument("--docs", default="docs/reports/results-study.md", help="results page to write (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the commands (with done/todo) and run nothing")
    p.set_defaults(func=_reproduce)


def _reproduce(args: argparse.Namespace) -> int:
    docs = reproduce.run_study(reproduce.BUDGETS[args.budget], args.out, args.target, args.ablations, args.data,
                              args.docs, args.dry_run)
    if docs is not None:
        print(f"wrote {docs}")
    return 0


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="end-to-end demo: prepare SmolLM2, take the shipped DSpark drafter, compare decoding speed",
        description="Decodes a few evaluation prompts (greedy) with plain decoding, prompt lookup, DSpark and hybrid "
        "drafting and prints acceptance length, speed and whether each row produced exactly the plain text. The "
        "drafter: --drafter, else the shipped reference drafter checkpoints/smollm2-135m-dspark (see its README), "
        "else (or with --train) a small one trained here for --train-minutes on answers the target regenerates. "
        "Every row must equal plain decoding exactly (the demo fails otherwise). The dtype: bfloat16 on a GPU and "
        "on a CPU with bf16 matmul units (AVX512-BF16, AMX), where one-token steps are computed as verify blocks "
        "compute their rows so that the texts stay exact (checked on the model at load; faster than float32 on "
        "such a CPU), else float32. --dtype sets it.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    add_target_options(p)
    p.add_argument("--drafter", default=None, help="a DSpark checkpoint folder to use instead of the shipped one")
    p.add_argument("--train", action="store_true",
                   help="train a demo drafter from scratch (resumable, in --work-dir) instead of the shipped one")
    add_drafter_options(p)
    p.add_argument("--work-dir", default=None, help="where demo data and the demo drafter go (default: $DSPARK_HOME/demo)")
    p.add_argument("--train-minutes", type=float, default=5.0, help="training time for a new demo drafter (default: %(default)s)")
    p.add_argument("--num-train-prompts", type=int, default=96, help="prompts regenerated for training (default: %(default)s)")
    p.add_argument("--prompts-per-set", type=int, default=2, help="evaluation prompts per benchmark (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default: %(default)s)")
    p.add_argument("--draft-vocab-size", type=int, default=4096, metavar="N",
                   help="without --draft-vocab, build one of N tokens from the drafter's own training data "
                   "(its train_config.json), 0 = draft from the whole vocabulary (default: %(default)s)")
    p.add_argument("--policy", default="alg1", metavar="POLICY",
                   help=f"how the DSpark and hybrid rows choose how many drafts to verify: {POLICY_HELP}; alg1 and "
                   "async plan on the whole step's cost profiled on this machine at the start (a few seconds) and "
                   "the drafter's sts.json; all = verify every draft (default: %(default)s)")
    # the cheapest drafting measured on a CPU (docs/reports/performance.md); --head-top-m 0 undoes it
    p.set_defaults(func=run_demo, head_top_m=64)
