"""`dspark serve` (OpenAI-compatible HTTP server) and `dspark bench serve` (load benchmark).

``bench`` is a command group other modules extend: call
``bench_subparsers(sub)`` with the root subparsers to get (creating it once)
the group's subparsers, then ``add_parser("speed", ...)`` on it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import weakref

from dspark.target.presets import DEFAULT_TARGET
from dspark.drafters.options import DraftingOptions, add_drafter_options, add_target_options, load_target_from_args

_BENCH_GROUPS: "weakref.WeakKeyDictionary[argparse._SubParsersAction, argparse._SubParsersAction]" = (
    weakref.WeakKeyDictionary()
)


def bench_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The subparsers of `dspark bench`, created on first call for this root parser."""
    group = _BENCH_GROUPS.get(sub)
    if group is None:
        p = sub.add_parser("bench", help="benchmarks (`dspark bench serve`: serving load test)",
                           description="Benchmarks; see `dspark bench COMMAND --help`.")
        group = p.add_subparsers(dest="bench_command", metavar="COMMAND")
        p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
        _BENCH_GROUPS[sub] = group
    return group


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from dspark.scheduler.adapter import POLICY_HELP

    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    add_target_options(p)
    p.add_argument("--drafter", default="prompt-lookup",
                   help="none | prompt-lookup | a DSpark/DFlash/Eagle3 checkpoint folder | an HF causal-LM folder "
                   "(default: %(default)s)")
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    add_drafter_options(p)
    p.add_argument("--sps-table", default=None,
                   help="SGLang-format SPS JSON from `dspark profile`; without it alg1/async profile quickly at start")
    p.add_argument("--sts", default=None, help="STS JSON (per-position confidence temperatures)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is often fastest on a busy shared CPU)")
    p.add_argument("--fallback-confidence", type=float, default=1.0,
                   help="confidence given to drafters without a confidence head (default: %(default)s; "
                   f"policies: {POLICY_HELP})")


def add_cli(sub: argparse._SubParsersAction) -> None:
    from dspark.scheduler.adapter import POLICY_HELP

    p = sub.add_parser(
        "serve", help="serve an OpenAI-compatible HTTP API with speculative decoding and continuous batching",
        description="POST /v1/completions, /v1/chat/completions (stream or not), GET /v1/models, /health, /metrics. "
        "Greedy requests (temperature 0) return exactly the target's greedy output. "
        "Example: dspark serve --target smollm2-135m --drafter prompt-lookup --policy alg1 --port 8000",
    )
    _add_model_args(p)
    p.add_argument("--policy", default="all", help=f"verify policy: {POLICY_HELP} (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=8, help="most requests decoded together (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for a slot; beyond it the server answers 429 (default: %(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens when a request gives none (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s; 0.0.0.0 to expose)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $DSPARK_API_KEY)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default: %(default)s)")
    p.set_defaults(func=_serve)

    b = bench_subparsers(sub).add_parser(
        "serve", help="load-test the server per verify policy and concurrency (paper Figs. 7, 8)",
        description="Starts an in-process server per policy and runs closed-loop HTTP clients on 127.0.0.1. "
        "Writes serve_load.json, serve_load.md, throughput_vs_user_speed.png and verify_budget.png. "
        "Example: dspark bench serve --policies fixed:1,alg1,async,all --concurrency 1,2,4,8 "
        "--num-requests 16 --max-tokens 64",
    )
    _add_model_args(b)
    b.add_argument("--policies", type=_comma_list, default=["fixed:1", "alg1", "async", "all"],
                   help=f"comma-separated policies ({POLICY_HELP}) (default: fixed:1,alg1,async,all)")
    b.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8],
                   help="comma-separated client counts (default: 1,2,4,8)")
    b.add_argument("--num-requests", type=int, default=16,
                   help="requests per point, at least the concurrency (default: %(default)s)")
    b.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: %(default)s)")
    b.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    b.add_argument("--prompts", default=None,
                   help='{"turns": [...]} JSONL (first turn used); default: a mix of shared/data/eval')
    b.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds per point after which clients send no new requests (default: %(default)s)")
    b.add_argument("--seed", type=int, default=0, help="request i uses seed + i (default: %(default)s)")
    b.add_argument("--url", default=None, help="measure this running server instead of starting one per policy")
    b.add_argument("--api-key", default=None, help="API key for --url (default: $DSPARK_API_KEY)")
    b.add_argument("--out-dir", default="docs/serving", help="(default: %(default)s)")
    b.set_defaults(func=_bench_serve)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        if threads < 1:
            from dspark.errors import DSparkError

            raise DSparkError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from dspark.drafters.registry import load_drafter
    from dspark.errors import ModelLoadError
    from dspark.evaluation.calibration import load_sts_json
    from dspark.scheduler.profile import load_or_profile
    from dspark.serving.engine import Engine, EngineConfig
    from dspark.scheduler.adapter import make_policy, parse_policy
    from dspark.serving.server import ServerConfig, create_app

    spec = parse_policy(args.policy)
    _set_threads(args.threads)
    target = load_target_from_args(args)
    if target.tokenizer is None:
        raise ModelLoadError(f"{args.target} has no tokenizer; the server needs one to read prompts")
    drafter = load_drafter(args.drafter, target, DraftingOptions.from_args(args))
    sps = None
    if spec.needs_sps_table:
        sps = load_or_profile(args.sps_table, target, max(drafter.block_size, 1), args.max_batch,
                              drafter.target_layer_ids)
    temps = load_sts_json(args.sts, drafter.block_size) if args.sts else None
    policy = make_policy(args.policy, sps, temps, args.fallback_confidence)
    engine = Engine(target, drafter, policy, EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue))
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or None
    config = ServerConfig(model_name=args.served_model_name or args.target, api_key=api_key,
                          default_max_tokens=args.default_max_tokens)
    app = create_app(engine, target.tokenizer, config)
    print(f"[dspark] serving {config.model_name} with drafter {args.drafter}, policy {policy.name} on "
          f"http://{args.host}:{args.port}/v1{' (API key required)' if api_key else ''}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from dspark.bench.serve_load import SweepConfig, run_sweep, write_report

    _set_threads(args.threads)
    cfg = SweepConfig(
        target=args.target, drafter=args.drafter, policies=args.policies, concurrency=args.concurrency,
        num_requests=args.num_requests, max_tokens=args.max_tokens, temperature=args.temperature,
        prompts=args.prompts, block_size=args.block_size, head_top_m=args.head_top_m,
        draft_vocab=args.draft_vocab, sps_table=args.sps_table, sts=args.sts,
        fallback_confidence=args.fallback_confidence, time_limit_s=args.time_limit, seed=args.seed,
        url=args.url, api_key=args.api_key or os.environ.get("DSPARK_API_KEY") or None,
    )
    rows, meta = run_sweep(cfg)
    flags = sys.argv[1:]
    if flags[:2] == ["bench", "serve"]:  # `dspark bench serve ...`; bench/serve_load.py passes the flags only
        flags = flags[2:]
    command = " ".join(["dspark", "bench", "serve", *(shlex.quote(a) for a in flags)])
    for path in write_report(rows, meta, args.out_dir, command):
        print(f"wrote {path}")
    return 0
