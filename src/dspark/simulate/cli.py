"""`dspark simulate`: the serving load test on paper, from an SPS table and a drafter's acceptance statistics.

Examples::

    dspark simulate --sps-table sps.json --stats runs/eval/results.json --drafter-name pld \\
        --trace runs/eval/samples.jsonl --users 1,2,4 --num-requests 8 --policies fixed:1,alg1,all
    dspark simulate --roofline dense-8b-h200 --paper-drafter DSpark --no-prefill --users 1,8,32,64,128,200 \\
        --duration 600 --warmup 30 --policies fixed:1,fixed:7,threshold:0.5,alg1,async --out-dir docs/serving/simulated
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dspark.errors import DSparkError

ROOFLINES = ("dense-8b-h200",)
#: a table whose steps/s grow by more than this factor from its first to its last sample holds tokens/s
TREND_LIMIT = 1.5


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DSparkError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise DSparkError(f"{what}: expected positive numbers, got {text!r}")
    return values


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="simulate serving load (throughput vs per-user speed, verify budget) from an SPS table "
        "and drafter statistics", description=__doc__.split("Examples")[0].strip() + " Runs the production "
        "verify policies in a discrete-event model of the continuous-batching engine; writes simulate.json, "
        "simulate.md and the paper's Figures 7 and 8 into --out-dir.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("hardware")
    g.add_argument("--sps-table", help="SPS JSON (`dspark profile`, or SGLang's): times every verify step")
    g.add_argument("--roofline", choices=ROOFLINES, help="a roofline-derived SPS table instead (simulate/roofline.py)")
    g.add_argument("--prefill-sps-table", help="SPS JSON for prefill batches (default: --sps-table, extrapolated)")
    g.add_argument("--policy-sps-table",
                   help="the SPS JSON alg1/async plan with, when it is not the one that times the steps (e.g. "
                   "timing from a load test's observed_verify_sps.json, planning with the table that test's server "
                   "was given); default: --sps-table / --roofline")
    g.add_argument("--no-prefill", action="store_true", help="prefill runs elsewhere (disaggregated): costs 0")
    g.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="drafting and host time added to every step (default: %(default)s)")
    d = p.add_argument_group("drafter")
    d.add_argument("--stats", help="drafter-statistics JSON, or a `dspark eval` results.json (every draft verified)")
    d.add_argument("--drafter-name", help="which drafter of a results.json (and of a --trace samples.jsonl)")
    d.add_argument("--per-request-stats", action="store_true",
                   help="each request of --trace (a `dspark eval` samples.jsonl) drafts from that record's own "
                   "statistics, in trace order, instead of its benchmark's pooled ones: requests then differ as "
                   "much as the measured ones did, which per-user speed (a mean over requests) depends on; for "
                   "drafters without a confidence head")
    d.add_argument("--paper-drafter", choices=("DSpark", "DFlash", "Eagle3"),
                   help="the paper's acceptance (Table 1, Fig. 2; simulate/paper.py) instead of --stats")
    d.add_argument("--paper-target", default="Qwen3-8B", help="Table 1 row for --paper-drafter (default: %(default)s)")
    d.add_argument("--block-size", type=int, default=None, help="refuse statistics of another block size")
    d.add_argument("--fallback-confidence", type=float, default=1.0,
                   help="confidence of drafters without a confidence head (default: %(default)s)")
    w = p.add_argument_group("load")
    w.add_argument("--policies", default="fixed:1,alg1,async,all", help="comma-separated (default: %(default)s)")
    w.add_argument("--users", default=None, help="closed-loop users, comma-separated (as bench serve --concurrency)")
    w.add_argument("--rate", default=None, help="Poisson arrival rates in requests/s, comma-separated")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests per point, at least the users (as bench serve); or give --duration")
    w.add_argument("--duration", type=float, default=None, help="simulated seconds per point")
    w.add_argument("--warmup", type=float, default=0.0, help="with --duration: unmeasured start (default: 0)")
    w.add_argument("--trace", help="JSONL with prompt_tokens and new_tokens (or output_tokens) per request, e.g. "
                   "`dspark eval`'s samples.jsonl; used round-robin")
    w.add_argument("--prompt-len", type=int, default=128, help="without --trace (default: %(default)s)")
    w.add_argument("--output-len", type=int, default=256, help="without --trace (default: %(default)s)")
    w.add_argument("--max-batch", type=int, default=None, help="engine slots (default: the users, or 256)")
    w.add_argument("--prefill-chunk", type=int, default=256,
                   help="most prompt tokens prefilled between two steps, as the engine; 0 = whole prompts "
                   "(default: %(default)s)")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--compare", help="a `dspark bench serve` serve_load.json: report simulated vs measured")
    o.add_argument("--budget-with-anchor", action="store_true",
                   help="plot 1 + verify length (the paper's Fig. 8 axis) in verify_budget.png")
    o.add_argument("--out-dir", default="runs/simulate", help="(default: %(default)s)")
    p.set_defaults(func=_simulate)


def load_sps(path: str, what: str = "--sps-table"):
    """SPSTable.load plus the simulator's own check: steps/s must not grow with batch tokens."""
    from dspark.scheduler.sps import SPSTable
    from dspark.simulate.stats import StatsError

    try:
        table = SPSTable.load(path)
    except ValueError as err:
        raise StatsError(f"{what}: {err}" if str(path) in str(err) else f"{what} {path}: {err}") from None
    first, last = table.sample_steps_per_sec[0], table.sample_steps_per_sec[-1]
    if last > TREND_LIMIT * first:
        raise StatsError(f"{what} {path}: steps/s rise from {first:g} to {last:g} with batch tokens; a step over "
                         "more tokens cannot be faster (is this tokens/s instead of steps/s?)")
    return table


def load_trace(path: str, drafter: str | None = None) -> tuple[list[tuple[int, int]], list[dict]]:
    """(prompt tokens, output tokens) per request of a trace, and its records; records of a `dspark eval`
    samples.jsonl that name another drafter than ``drafter`` are left out."""
    lengths, records = [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except OSError as err:
        raise DSparkError(f"trace {path}: {err.strerror}") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if drafter is not None and rec.get("drafter", drafter) != drafter:
                continue
            out = rec["new_tokens"] if "new_tokens" in rec else rec["output_tokens"]
            lengths.append((int(rec["prompt_tokens"]), int(out)))
            records.append(rec)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise DSparkError(f"trace {path}:{i + 1}: expected JSON with prompt_tokens and new_tokens") from None
    if not lengths or any(p < 1 or o < 1 for p, o in lengths):
        raise DSparkError(f"trace {path}: needs requests with prompt_tokens >= 1 and new_tokens >= 1"
                          + (f" (of drafter {drafter!r})" if drafter else ""))
    return lengths, records


def _simulate(args: argparse.Namespace) -> int:
    from dspark.scheduler.adapter import parse_policy
    from dspark.simulate.engine import StepClock, Workload
    from dspark.simulate.report import compare, matched_throughput, sweep, write_report
    from dspark.simulate.stats import load_stats

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        parse_policy(name)  # a typo fails before any simulation
    if (args.sps_table is None) == (args.roofline is None):
        raise DSparkError("give --sps-table or --roofline")
    if sum(x is not None for x in (args.stats, args.paper_drafter)) + args.per_request_stats != 1:
        raise DSparkError("give one of --stats, --paper-drafter, --per-request-stats")
    if args.per_request_stats and not args.trace:
        raise DSparkError("--per-request-stats reads each request's statistics from --trace (a `dspark eval` "
                          "samples.jsonl); give --trace")
    if (args.users is None) == (args.rate is None):
        raise DSparkError("give --users or --rate")
    if (args.num_requests is None) == (args.duration is None):
        raise DSparkError("give --num-requests or --duration")
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise DSparkError(f"--out-dir {args.out_dir} is a file, not a folder")
    meta: dict = {}
    if args.roofline:
        from dspark.simulate.roofline import dense_8b_h200

        roof = dense_8b_h200()
        verify = roof.table()
        meta["roofline"] = roof.describe()
    else:
        verify = load_sps(args.sps_table)
    prefill = load_sps(args.prefill_sps_table, "--prefill-sps-table") if args.prefill_sps_table else None
    lengths, records = load_trace(args.trace, args.drafter_name) if args.trace else ([(args.prompt_len,
                                                                                    args.output_len)], [])
    domains = None
    if args.paper_drafter:
        from dspark.simulate.paper import paper_drafters

        stats = paper_drafters(args.paper_target)[args.paper_drafter]
    elif args.per_request_stats:
        from dspark.simulate.stats import StatsError, per_request_stats

        try:
            stats = per_request_stats(records, args.drafter_name or "drafter", args.trace)
        except (ValueError, KeyError, TypeError) as err:
            raise StatsError(f"trace {args.trace}: {err}") from None
        if args.block_size is not None and stats.block_size != args.block_size:
            raise StatsError(f"trace {args.trace}: statistics are for block size {stats.block_size}, "
                             f"not {args.block_size}")
        domains = list(range(len(records)))  # request i drafts as trace record i did
    else:
        stats = load_stats(args.stats, args.drafter_name, args.block_size)
    loads = _floats(args.users or args.rate, "--users" if args.users else "--rate")
    if args.users and any(u != int(u) for u in loads):
        raise DSparkError(f"--users must be whole numbers, got {args.users}")
    if args.users and max(loads) > verify.max_batch_tokens:
        raise DSparkError(f"{args.sps_table or args.roofline}: max_batch_tokens {verify.max_batch_tokens} is below "
                          f"{max(loads):g} users (one token each); profile larger batches")
    clock = StepClock(verify, prefill, not args.no_prefill, args.step_overhead_ms / 1e3)

    def workload(load: float) -> Workload:
        closed = args.users is not None
        n = None if args.num_requests is None else max(args.num_requests, int(load) if closed else 1)
        return Workload(users=int(load) if closed else 0, rate=0.0 if closed else load, num_requests=n,
                        duration_s=args.duration, warmup_s=args.warmup, lengths=lengths, domains=domains,
                        max_batch=args.max_batch,
                        prefill_chunk=args.prefill_chunk or None)

    meta.update(drafter=stats.name, block_size=stats.block_size, stats_source=stats.source,
                domains={n: {"tau_verify_all": stats.tau_verify_all(n)} for n in stats.domains},
                has_confidence=stats.has_confidence, sps_table=args.sps_table or args.roofline,
                policy_sps_table=args.policy_sps_table,
                step_overhead_ms=args.step_overhead_ms, prefill=not args.no_prefill, num_lengths=len(lengths))
    print(f"[dspark] simulating {stats.name} (block size {stats.block_size}) on {meta['sps_table']}")
    policy_sps = load_sps(args.policy_sps_table, "--policy-sps-table") if args.policy_sps_table else None
    rows = sweep(policies, loads, stats, clock, workload, args.seed, args.fallback_confidence,
                 policy_sps=policy_sps)
    meta["matched_throughput"] = {f"{p} vs {b}": matched_throughput(rows, p, b)
                                  for b in policies if b.startswith("fixed:") for p in policies if p != b}
    comparison = []
    if args.compare:
        try:
            measured = json.loads(Path(args.compare).read_text(encoding="utf-8"))["rows"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise DSparkError(f"--compare {args.compare}: not a serve_load.json ({err})") from None
        comparison = compare(rows, measured)
    command = "dspark " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[0].endswith("dspark") else ""
    paths = write_report(rows, meta, args.out_dir, command, comparison, args.budget_with_anchor)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
