"""`dspark eval` (tau tables, acceptance curves, threshold sweeps) and `dspark calibrate` (STS).

Examples::

    dspark eval --drafter pld=prompt-lookup --datasets gsm8k,mt-bench --limit 5 --max-new-tokens 128
    dspark eval --drafter dspark=runs/train/dspark --drafter dflash=runs/train/dflash --out runs/eval
    dspark eval --drafter dspark=runs/train/dspark --sweep-thresholds 0,0.2,0.4,0.6,0.8 --out runs/sweep
    dspark calibrate --drafter runs/train/dspark --limit 50 --out runs/calibrate
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.errors import DSparkError
from dspark.tables import fmt
from dspark.data.eval_sets import DEFAULT_SEED, EvalDataset
from dspark.cli_options import add_drafter_options, add_target_options, drafting_options, load_target_from_args

DEFAULT_MAX_NEW_TOKENS = 2048  # DeepSpec's evaluator


def parse_named(value: str, what: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (NAME, VALUE); a bare VALUE is named after its last path component."""
    name, sep, rest = value.partition("=")
    if sep and name and rest:
        return name.strip(), rest.strip()
    if sep:
        raise DSparkError(f"{what} {value!r}: expected NAME=VALUE or VALUE")
    return Path(value.rstrip("/")).name or value, value


def parse_jsonl(value: str) -> tuple[str, str]:
    """``[NAME=]FILE`` -> (NAME, FILE); NAME defaults to the file stem."""
    name, path = parse_named(value, "--jsonl")
    return (Path(path).stem if "=" not in value else name), path


def _add_common(p: argparse.ArgumentParser) -> None:
    from dspark.target.presets import DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help="target preset or HF folder (default: %(default)s)")
    add_target_options(p)
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    add_drafter_options(p)
    p.add_argument("--datasets", default=None,
                   help="comma-separated benchmarks (gsm8k, math500, aime25, mbpp, humaneval, livecodebench, "
                   "mt-bench, arena-hard-v2), domains (math, code, chat) or 'all'")
    p.add_argument("--jsonl", action="append", default=[], metavar="[NAME=]FILE",
                   help="a JSONL of {\"turns\": [...]} records (first turn used); repeatable")
    p.add_argument("--eval-dir", default=None,
                   help="folder with the benchmark JSONL files (default: $DSPARK_EVAL_DIR, else the sets shipped with dspark)")
    p.add_argument("--limit", type=int, default=None, help="at most N samples per set (shuffled with --seed, then cut)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: %(default)s)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="selection seed; sample i uses seed + i "
                   "(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per static batch (default: %(default)s, "
                   "as DeepSpec)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="offline acceptance evaluation: tau tables, per-position curves, threshold sweeps",
        description="Decodes the evaluation prompts with each drafter (temperature 1.0, every draft verified "
        "unless --threshold) and writes results.json, results.md (paper Table 1) and acceptance_<domain>.png "
        "(Fig. 2) into --out. Resumable: samples already in --out/samples.jsonl are skipped. With "
        "--sweep-thresholds it runs the static-threshold sweep instead (Fig. 5) into --out/sweep/<drafter>.",
    )
    _add_common(p)
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=SPEC",
                   help="none | prompt-lookup | a DSpark/DFlash/Eagle3 checkpoint folder | an HF draft model; "
                   "repeatable")
    p.add_argument("--out", default="runs/eval", help="output folder (default: %(default)s)")
    p.add_argument("--threshold", type=float, default=None,
                   help="static confidence threshold: verify drafts up to the first sigmoid(logit) below it "
                   "(drafters without a confidence head verify every draft)")
    p.add_argument("--sts", action="append", default=[], metavar="NAME=FILE",
                   help="STS temperatures (from `dspark calibrate`) for drafter NAME: applied before --threshold "
                   "and reported as calibrated confidence metrics")
    p.add_argument("--sweep-thresholds", default=None, metavar="T1,T2,...",
                   help="run the static-threshold sweep over these thresholds (paper Fig. 5)")
    p.set_defaults(func=_eval)

    c = sub.add_parser(
        "calibrate", help="fit sequential temperature scaling (STS) of a confidence head on held-out prompts",
        description="Decodes held-out prompts with every draft verified, records confidence logits and acceptance "
        "(shards), fits one temperature per draft position (STS) and writes sts.json (SGLang format), "
        "calibration.json/.md (ECE, AUROC, Brier per position before and after) and reliability.png (Fig. 6). "
        "Held-out prompts default to the benchmark rows beyond their evaluation caps (gsm8k, mbpp, "
        "livecodebench, arena-hard-v2), disjoint from what `dspark eval` with the same --seed evaluates; "
        "--jsonl uses your own prompt files instead.",
    )
    _add_common(c)
    c.add_argument("--drafter", required=True, metavar="SPEC",
                   help="a DSpark checkpoint folder (with a confidence head)")
    c.add_argument("--name", default=None, help="drafter name for the report (default: the folder name)")
    c.add_argument("--ece-bins", type=int, default=20,
                   help="equal-width ECE bins for fit and report (default: %(default)s)")
    c.add_argument("--out", default="runs/calibrate", help="output folder (default: %(default)s)")
    c.set_defaults(func=_calibrate)


# --------------------------------------------------------------------------- helpers


def eval_datasets(args: argparse.Namespace) -> list[EvalDataset]:
    from dspark.data.eval_sets import load_eval_dataset, load_jsonl_dataset, parse_dataset_names

    names = parse_dataset_names(args.datasets or ("" if args.jsonl else "all"))
    sets = [load_eval_dataset(n, args.eval_dir, args.limit, args.seed) for n in names]
    for item in args.jsonl:
        name, path = parse_jsonl(item)
        sets.append(load_jsonl_dataset(path, name, limit=args.limit, seed=args.seed))
    if not sets:
        raise DSparkError("no datasets: give --datasets and/or --jsonl")
    return sets


def heldout_datasets(args: argparse.Namespace) -> tuple[list[EvalDataset], str]:
    from dspark.data.eval_sets import heldout_dataset, heldout_names, load_jsonl_dataset, parse_dataset_names

    if args.jsonl:
        if args.datasets:
            raise DSparkError("give either --jsonl (your held-out prompts) or --datasets (benchmark rows beyond "
                              "the evaluation caps), not both")
        sets = []
        for item in args.jsonl:
            name, path = parse_jsonl(item)
            sets.append(load_jsonl_dataset(path, name, limit=args.limit, seed=args.seed, cap=10**9))
        return sets, "prompt files " + ", ".join(s.source or s.name for s in sets)
    names = parse_dataset_names(args.datasets) if args.datasets else heldout_names(args.eval_dir)
    sets = [heldout_dataset(n, args.eval_dir, args.limit, args.seed) for n in names]
    desc = (f"benchmark rows beyond the evaluation caps (shuffle seed {args.seed}), disjoint from the evaluated "
            "samples: " + ", ".join(f"{s.name} {len(s)}" for s in sets))
    return sets, desc


def _load(args: argparse.Namespace):
    return load_target_from_args(args)


# --------------------------------------------------------------------------- commands


def _eval(args: argparse.Namespace) -> int:
    from dspark.drafters.registry import load_drafter
    from dspark.scheduler.sts import load_sts_json
    from dspark.evaluation.report import comparison_table, tau_table
    from dspark.evaluation.runner import evaluate
    from dspark.evaluation.sweep import parse_thresholds, sweep_thresholds
    from dspark.scheduler.policies import StaticThreshold

    named = [parse_named(d, "--drafter") for d in args.drafter]
    if len({n for n, _ in named}) != len(named):
        raise DSparkError(f"drafter names must be unique: {[n for n, _ in named]}; use NAME=SPEC")
    sts_files = dict(parse_named(s, "--sts") for s in args.sts)
    unknown = set(sts_files) - {n for n, _ in named}
    if unknown:
        raise DSparkError(f"--sts names {sorted(unknown)} match no --drafter NAME")
    if args.threshold is not None and args.sweep_thresholds:
        raise DSparkError("give --threshold or --sweep-thresholds, not both")
    thresholds = parse_thresholds(args.sweep_thresholds) if args.sweep_thresholds else None
    datasets = eval_datasets(args)
    target = _load(args)
    drafters = {name: load_drafter(spec, target, drafting_options(args)) for name, spec in named}
    temperatures = {n: load_sts_json(path, drafters[n].block_size) for n, path in sts_files.items()}
    progress = not args.no_progress
    out = Path(args.out)
    if thresholds is not None:
        for name, spec in named:
            rows = sweep_thresholds(
                target, drafters[name], datasets, thresholds, out / "sweep" / name, name=name,
                temperatures=temperatures.get(name), temperature=args.temperature,
                max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
                drafter_spec=spec, progress=progress,
            )
            for r in rows:
                print(f"{name:>12} {r['domain']:>8} t={r['threshold']:<5g} verified/step {r['verified_per_step']:.2f} "
                      f"accepted/step {r['accepted_per_step']:.2f} rate {r['acceptance_rate'] or 0:.3f}")
        print(f"wrote {out / 'sweep'}")
        return 0
    policy = StaticThreshold(args.threshold) if args.threshold is not None else None
    results = evaluate(
        target, drafters, datasets, args.temperature, args.max_new_tokens, args.seed, out, policy,
        batch_size=args.batch_size, temperatures=temperatures, drafter_specs=dict(named), progress=progress,
    )
    print("\n".join(tau_table(results)))
    if results.get("comparisons"):
        print("\n".join(["", "paired differences of tau (95 % bootstrap intervals over prompts):",
                         *comparison_table(results)]))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from dspark.drafters.registry import load_drafter
    from dspark.evaluation.runner import calibrate

    datasets, heldout = heldout_datasets(args)
    target = _load(args)
    drafter = load_drafter(args.drafter, target, drafting_options(args))
    name = args.name or parse_named(args.drafter, "--drafter")[0]
    report = calibrate(
        target, drafter, datasets, args.out, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, n_bins=args.ece_bins, drafter_name=name, heldout=heldout,
        progress=not args.no_progress,
    )
    print(f"temperatures: {', '.join(f'{t:.3g}' for t in report['temperatures'])}")
    b, a = report["before"], report["after"]
    print(f"ECE {fmt(b['ece_mean'], 4)} -> {fmt(a['ece_mean'], 4)}, AUROC {fmt(b['auc_mean'], 3)}, "
          f"Brier {fmt(b['brier_mean'], 4)} -> {fmt(a['brier_mean'], 4)} over {report['num_steps']} steps")
    print(f"wrote {report['sts_path']} and {Path(args.out) / 'calibration.md'}")
    return 0
