"""The commands of the `dspark bench` group: `bench serve` (serving load test), `bench speed` (decoding speed)
and `bench chaos` (faults and load).

``dspark.cli`` creates the group and calls ``add_serve`` and ``add_speed`` with its subparsers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile
import sys
from pathlib import Path

from dspark.bench import train as train_bench
from dspark.cli_options import add_device_option, add_dtype_option, resolve_target_args
from dspark.data.eval_sets import DEFAULT_SEED
from dspark.errors import DSparkError
from dspark.evaluation.cli import parse_jsonl
from dspark.serving.cli import add_model_args, set_threads
from dspark.target.loading import resolve_device
from dspark.target.presets import DEFAULT_TARGET

DEFAULT_SPEED_OUT = "docs/performance"
DEFAULT_SPEED_DOC = "docs/reports/performance.md"  # one section per --out-dir


# ---------------------------------------------------------------- flag values

def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(t) for t in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected temperatures >= 0, got {text!r}")
    return values


def _named_path(text: str) -> list[str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"expected NAME=CHECKPOINT (e.g. dspark-markov=runs/x/step_latest), got {text!r}")
    return [name.strip(), path.strip()]


def _command_line(command: str) -> str:
    """The `dspark bench COMMAND ...` that ran, for the report (a script calling ``main(["bench", COMMAND, *flags])``
    has only the flags in its argv)."""
    flags = sys.argv[1:]
    if "bench" in flags and command in flags:  # `dspark [--threads N] bench COMMAND ...`
        flags = flags[: flags.index("bench")] + flags[flags.index(command) + 1:]
    return " ".join(["dspark", "bench", command, *(shlex.quote(a) for a in flags)])


# ---------------------------------------------------------------- dspark bench serve

def add_serve(bench: argparse._SubParsersAction) -> None:
    from dspark.scheduler.adapter import POLICY_HELP

    b = bench.add_parser(
        "serve", help="load-test the server per verify policy and concurrency (paper Figs. 7, 8)",
        description="Starts an in-process server per policy and runs closed-loop HTTP clients on 127.0.0.1. "
        "Writes serve_load.json, serve_load.md, throughput_vs_user_speed.png and verify_budget.png. "
        "Example: dspark bench serve --policies fixed:1,alg1,async,all --concurrency 1,2,4,8 "
        "--num-requests 16 --max-tokens 64",
    )
    add_model_args(b)
    b.add_argument("--policies", type=_comma_list, default=["fixed:1", "alg1", "async", "all"],
                   help=f"comma-separated policies ({POLICY_HELP}) (default: fixed:1,alg1,async,all)")
    b.add_argument("--concurrency", type=_positive_ints, default=[1, 2, 4, 8],
                   help="comma-separated client counts (default: 1,2,4,8)")
    b.add_argument("--num-requests", type=int, default=16,
                   help="requests per point, at least the concurrency (default: %(default)s)")
    b.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: %(default)s)")
    b.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    b.add_argument("--prompts", default=None,
                   help='{"turns": [...]} JSONL (first turn used); default: a mix of the packaged evaluation sets')
    b.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds per point after which clients send no new requests (default: %(default)s)")
    b.add_argument("--seed", type=int, default=0, help="request i uses seed + i (default: %(default)s)")
    b.add_argument("--url", default=None, help="measure this running server instead of starting one per policy")
    b.add_argument("--api-key", default=None, help="API key for --url (default: $DSPARK_API_KEY)")
    b.add_argument("--out-dir", default="docs/serving", help="(default: %(default)s)")
    b.set_defaults(func=_bench_serve)


def _bench_serve(args: argparse.Namespace) -> int:
    from dspark.bench.serve_load import SweepConfig, run_sweep, write_report

    set_threads(args.threads)
    device, dtype = resolve_target_args(args) if not args.url else ("cpu", "float32")  # --url: nothing loaded here
    cfg = SweepConfig(
        target=args.target, device=device, dtype=dtype, compile=args.compile, drafter=args.drafter, policies=args.policies, concurrency=args.concurrency,
        num_requests=args.num_requests, max_tokens=args.max_tokens, temperature=args.temperature,
        prompts=args.prompts, block_size=args.block_size, head_top_m=args.head_top_m,
        draft_vocab=args.draft_vocab, sps_table=args.sps_table, profile_step_cost=args.profile_step_cost, sts=args.sts,
        fallback_confidence=args.fallback_confidence, time_limit_s=args.time_limit, seed=args.seed,
        url=args.url, api_key=args.api_key or os.environ.get("DSPARK_API_KEY") or None,
    )
    rows, meta = run_sweep(cfg)
    for path in write_report(rows, meta, args.out_dir, _command_line("serve")):
        print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------- dspark bench chaos

def add_chaos(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser(
        "chaos", help="faults and load against an in-process server: malformed requests, concurrent clients, "
        "head-of-line blocking, slow connections",
        description="Starts the server on 127.0.0.1 and sends 150+ malformed requests (counting tracebacks in "
        "the server log and errors not in OpenAI's shape), --clients concurrent clients (counting lost requests), "
        "a short stream with and without a long prompt arriving (head-of-line ratio, chunked vs whole-prompt "
        "prefill) and --slow-connections slowloris connections (held time vs the header timeout). Writes --doc. "
        "Example: dspark --threads 1 bench chaos --target tiny",
    )
    b.add_argument("--target", default="tiny",
                   help="tiny (random 2-layer model, SmolLM2 tokenizer) or a preset / HF folder (default: %(default)s)")
    add_device_option(b)
    b.add_argument("--drafter", default="prompt-lookup", help="none | prompt-lookup | a checkpoint (default: %(default)s)")
    b.add_argument("--clients", type=int, default=64, help="(default: %(default)s)")
    b.add_argument("--slow-connections", type=int, default=64, help="(default: %(default)s)")
    b.add_argument("--header-timeout", type=float, default=2.0, help="seconds (default: %(default)s)")
    b.add_argument("--prefill-chunk", type=int, default=256, help="(default: %(default)s)")
    b.add_argument("--long-prompt-tokens", type=int, default=3000, help="(default: %(default)s)")
    b.add_argument("--hol-trials", type=int, default=3, help="(default: %(default)s)")
    b.add_argument("--threads", type=int, default=argparse.SUPPRESS,
                   help="torch CPU threads (default: the global --threads, else torch's choice)")
    b.add_argument("--doc", default="docs/reports/reliability.md", help="(default: %(default)s)")
    b.add_argument("--soak", type=int, default=None, metavar="N",
                   help="instead: a soak of N mixed requests (lengths, concurrency, streaming, cancellation, bad "
                   "input) against a `dspark serve` process, its RSS sampled, then SIGTERM with streams in flight; "
                   "writes the Soak section of --doc. Example: dspark bench chaos --soak 5000 --target smollm2-135m "
                   "--threads 1")
    b.add_argument("--soak-block", type=int, default=100, metavar="N",
                   help="requests per concurrency level; RSS is read after each (default: %(default)s)")
    b.add_argument("--soak-serve-args", default="", metavar="'FLAGS'",
                   help="more `dspark serve` flags for the soaked server, e.g. '--dtype bfloat16'")
    b.add_argument("--soak-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the soaked server (e.g. MALLOC_ARENA_MAX=8 to compare allocator settings)")
    b.set_defaults(func=_bench_chaos)


def _bench_chaos(args: argparse.Namespace) -> int:
    from dspark.bench.chaos import ChaosConfig, run_chaos, write_page

    if args.soak is not None:
        return _bench_soak(args)

    if min(args.clients, args.slow_connections, args.prefill_chunk, args.long_prompt_tokens, args.hol_trials) < 1:
        raise DSparkError("--clients, --slow-connections, --prefill-chunk, --long-prompt-tokens and --hol-trials "
                          "must be >= 1")
    set_threads(getattr(args, "threads", None))
    cfg = ChaosConfig(target=args.target, device=resolve_device(args.device), drafter=args.drafter,
                      clients=args.clients,
                      slow_connections=args.slow_connections, header_timeout_s=args.header_timeout,
                      prefill_chunk=args.prefill_chunk, long_prompt_tokens=args.long_prompt_tokens,
                      hol_trials=args.hol_trials)
    result = run_chaos(cfg, lambda msg: print(msg, file=sys.stderr, flush=True))
    path = write_page(result, _command_line("chaos"), args.doc)
    print(path.read_text())
    print(f"wrote {path}")
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    from dspark.bench.chaos_soak import SoakConfig, run_soak, write_soak_section

    if args.soak < 1 or args.soak_block < 1:
        raise DSparkError("--soak and --soak-block must be >= 1")
    env = dict(kv.split("=", 1) for kv in args.soak_env if "=" in kv)
    if len(env) != len(args.soak_env):
        raise DSparkError("--soak-env takes KEY=VALUE")
    target = "smollm2-135m" if args.target == "tiny" else args.target  # a server process needs a real folder
    cfg = SoakConfig(target=target, drafter=args.drafter, requests=args.soak, block=args.soak_block,
                     threads=getattr(args, "threads", None) or 1, env=env,
                     serve_args=shlex.split(args.soak_serve_args),
                     progress_path=str(Path(tempfile.gettempdir()) / f"dspark-soak-progress-{os.getpid()}.json"))
    log_path = Path(tempfile.gettempdir()) / f"dspark-soak-serve-{os.getpid()}.log"
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    result = run_soak(cfg, log_path, lambda msg: print(msg, file=sys.stderr, flush=True))
    Path(args.doc).with_suffix(".soak.json").write_text(json.dumps(result, indent=1))
    path = write_soak_section(result, _command_line("chaos"), args.doc)
    print(f"wrote {path} (server log {log_path})")
    return 0


# ---------------------------------------------------------------- dspark bench speed

def add_train(bench: argparse._SubParsersAction) -> None:
    """`dspark bench train`: drafter-training throughput, old path against new (``dspark.bench.train``)."""
    train_bench.add_cli(bench)


def add_speed(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "speed", help="single-request tokens/s: HF generate / prompt lookup / assisted vs our engine and drafters",
        description="Decodes the same evaluation prompts at batch size 1, greedy and at temperature 1.0, with HF "
        "transformers (generate, prompt lookup, assisted generation with --draft-lm) and our engine (plain, prompt "
        "lookup, --draft-lm, each --drafter at --block-sizes), interleaved per prompt after a warm-up. Reports "
        "tokens/s, ratios to hf-generate and ours-plain, acceptance length, draft/verify ms per step, the ideal "
        "speedup tau*t_AR/(t_draft+t_verify), efficiency, greedy equality with hf-generate and peak RSS. Writes "
        "OUT/speed.json, OUT/speed.md and the run's section of docs/reports/performance.md (one section per --out-dir).",
        epilog="example: dspark bench speed --draft-lm runs/smollm2-draft-lm/step_latest "
        "--drafter dspark-markov=runs/smollm2-dspark-markov/step_latest "
        "--drafter dflash=runs/smollm2-dflash/step_latest --drafter eagle3=runs/smollm2-eagle3/step_latest "
        "--block-sizes 7,4",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    p.add_argument("--sets", default="all",
                   help="comma-separated evaluation sets, domains (math, code, chat) or all (default: %(default)s)")
    p.add_argument("--jsonl", action="append", default=[], metavar="[NAME=]FILE", type=parse_jsonl,
                   help="also a JSONL of {\"turns\": [...]} records as a prompt set (first turn used; repeatable; "
                   "--sets '' for these only)")
    p.add_argument("--per-set", type=int, default=2, help="prompts per set (default: %(default)s)")
    p.add_argument("--eval-dir", default=None, help="folder of the evaluation JSONL files (default: $DSPARK_EVAL_DIR, else the sets shipped with dspark)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0], help="comma-separated (default: 0,1)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="sample idx of a set samples with seed + idx (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="skip longer prompts (the next of the set is taken) (default: %(default)s)")
    p.add_argument("--draft-lm", default=None, metavar="FOLDER",
                   help="distilled draft LM (`dspark train --config smollm2-draft-lm`) for hf-assisted and "
                   "ours-draft-lm")
    p.add_argument("--draft-lm-block-size", type=int, default=None,
                   help="draft tokens per step for both draft-LM rows (default: the folder's, else 4)")
    p.add_argument("--drafter", dest="drafters", action="append", type=_named_path, default=[],
                   metavar="NAME=CHECKPOINT", help="a trained DSpark/DFlash/Eagle3 checkpoint (repeatable)")
    p.add_argument("--block-sizes", type=_positive_ints, default=None,
                   help="comma-separated block sizes for every --drafter; larger than a checkpoint's own are skipped "
                   "(default: each checkpoint's own)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=7,
                   help="tokens proposed by prompt lookup, HF's and ours (default: %(default)s)")
    p.add_argument("--no-hf", dest="include_hf", action="store_false", help="skip the transformers rows")
    p.add_argument("--head-top-m", type=_positive_ints, default=None, metavar="M[,M...]",
                   help="also time every DSpark --drafter with its head restricted to the top M base tokens "
                   "(rows '<name>-topM'; see `dspark generate --help`)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="also time every DSpark/DFlash --drafter drafting only this `dspark data vocab` file's "
                   "tokens (with the last --head-top-m, if given)")
    p.add_argument("--hybrid", action="store_true",
                   help="also time every --drafter's cheapest variant with hybrid drafting (prompt lookup where the "
                   "context repeats an n-gram, the drafter elsewhere; rows '<row>+hybrid')")
    p.add_argument("--hybrid-min-ngram", type=int, default=3, metavar="N",
                   help="shortest repeated n-gram that switches a hybrid step to prompt lookup (default: %(default)s)")
    p.add_argument("--hybrid-static", action="store_true",
                   help="with --hybrid: also time the hybrid without its adaptive choice on shorter matches (rows "
                   "'<row>+hybrid-static'), the rule before it")
    p.add_argument("--policy", default="all",
                   help="how every --drafter row verifies: all (every draft) | fixed:N | alg1 | async | threshold:T; "
                   "alg1 and async plan as `dspark demo` does, on the drafter's whole step profiled at one request at "
                   "the start (a few seconds each) and its sts.json; rows named '<row>/POLICY' (prompt lookup and "
                   "plain verify every draft) (default: %(default)s)")
    add_device_option(p, help="where the target, the drafters and the HF models run (default: auto = cuda when "
                      "a GPU is available, else cpu)")
    add_dtype_option(p, "the target, the drafters and the HF models")
    p.add_argument("--compile", action="store_true",
                   help="also time ours-plain and every --drafter at each block size (its cheapest variant) with a "
                   "torch.compile'd target (rows named '+compile', measured in the same run)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the warm-up call (default: %(default)s)")
    p.add_argument("--threads", type=int, default=argparse.SUPPRESS,
                   help="torch CPU threads (default: the global --threads, else torch's choice)")
    p.add_argument("--out-dir", default=DEFAULT_SPEED_OUT, help="(default: %(default)s)")
    p.add_argument("--doc", default=DEFAULT_SPEED_DOC,
                   help="the Markdown page whose section for --out-dir this run (re)writes, the other sections kept "
                   "('' for none) (default: %(default)s)")
    p.add_argument("--doc-title", default=None, metavar="TITLE",
                   help="heading of the run's section of --doc (default: the section's present heading, else --out-dir)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="re-render speed.md and --doc from an earlier speed.json; measure nothing")
    p.set_defaults(func=_bench_speed)


def _bench_speed(args: argparse.Namespace) -> int:
    from dspark.bench.speed import run_speed_bench
    from dspark.bench.speed_methods import SpeedConfig
    from dspark.bench.speed_report import write_outputs
    from dspark.data.eval_sets import parse_dataset_names
    from dspark.scheduler.adapter import parse_policy

    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
    else:
        set_threads(getattr(args, "threads", None))
        device, dtype = resolve_target_args(args)
        parse_policy(args.policy)  # a bad --policy fails before anything loads
        for name in ("per_set", "max_new_tokens", "prompt_lookup_tokens", "warmup_tokens", "max_prompt_tokens",
                     "hybrid_min_ngram"):
            if getattr(args, name) < 1:
                raise DSparkError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        cfg = SpeedConfig(
            target=args.target, sets=parse_dataset_names(args.sets), per_set=args.per_set, eval_dir=args.eval_dir,
            max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens, draft_lm=args.draft_lm,
            draft_lm_block_size=args.draft_lm_block_size, drafters=args.drafters, block_sizes=args.block_sizes,
            prompt_lookup_tokens=args.prompt_lookup_tokens, include_hf=args.include_hf,
            warmup_tokens=args.warmup_tokens, dtype=dtype, device=device, compile=args.compile,
            head_top_m=args.head_top_m,
            draft_vocab=args.draft_vocab, hybrid=args.hybrid, hybrid_min_ngram=args.hybrid_min_ngram,
            hybrid_static=args.hybrid_static, jsonl=[list(item) for item in args.jsonl], policy=args.policy,
        )
        result = run_speed_bench(cfg, _command_line("speed"), lambda msg: print(msg, file=sys.stderr, flush=True))
    paths = write_outputs(result, args.out_dir, args.doc or None, args.doc_title)
    print(Path(paths[1]).read_text())
    for path in paths:
        print(f"wrote {path}")
    return 0
