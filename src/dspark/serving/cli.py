"""`dspark serve`: the OpenAI-compatible HTTP server.

``add_model_args`` and ``set_threads`` are shared with `dspark bench serve` (``dspark.bench.cli``), which
starts the same server per verify policy.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dspark.target.presets import DEFAULT_TARGET
from dspark.cli_options import add_drafter_options, add_target_options, count, drafting_options, load_target_from_args

# --max-prompt-tokens on a CPU: SmolLM2-135M prefilled an 8,190-token prompt in 48 s on one busy core, so
# half that is the most a client should wait for (docs/reports/reliability.md)
CPU_MAX_PROMPT_TOKENS = 4096
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # = serving.limits.DEFAULT_MAX_BODY_BYTES (not imported: start-up time)
# --kv-reserve's default: positions per slot held from the start, within a byte budget (vLLM's CPU build holds
# 4 GiB of KV cache by default); the prompts of the serving benchmarks fit (docs/serving/README.md)
AUTO_KV_RESERVE = 2048
KV_RESERVE_BUDGET = 4 * 2**30


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Target, drafter, verify-policy inputs and threads: the flags of `serve` and `bench serve`."""
    from dspark.scheduler.adapter import POLICY_HELP

    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    add_target_options(p)
    p.add_argument("--drafter", default="prompt-lookup",
                   help="none | prompt-lookup | a DSpark/DFlash/Eagle3 checkpoint folder | an HF causal-LM folder "
                   "(default: %(default)s)")
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    add_drafter_options(p)
    p.add_argument("--sps-table", default=None, metavar="FILE",
                   help="what alg1/async plan on: a whole-step cost model (`dspark profile --step-cost`) or an "
                   "SGLang-format SPS table (`dspark profile --out`, the verify pass alone); without it they "
                   "profile the whole step quickly at start (the verify pass alone for --drafter none)")
    p.add_argument("--profile-step-cost", default=None, metavar="FILE",
                   help="profile the whole step (drafting with --drafter, verify pass, host work) at start, save the "
                   "cost model to FILE and plan alg1/async on it (instead of --sps-table)")
    p.add_argument("--sts", default=None, help="STS JSON (per-position confidence temperatures)")
    p.add_argument("--threads", type=int, default=argparse.SUPPRESS,  # not None: `dspark --threads N serve` must keep N
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
    add_model_args(p)
    p.add_argument("--policy", default="all", help=f"verify policy: {POLICY_HELP} (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=8, help="most requests decoded together (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for a slot; beyond it the server answers 429 (default: %(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="cap on max_tokens when a request gives none (default: none, the room left in the context)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults (temperature, top_p, top_k) for fields a request omits: auto = the "
                   "target folder's generation_config.json, vllm = OpenAI's (1, 1, off), or a folder holding "
                   "a generation_config.json (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s; 0.0.0.0 to expose)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $DSPARK_API_KEY)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="larger request bodies get 413 before they are read (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="longer prompts get 400 (default: the model's context on a GPU; on a CPU at most "
                   f"{CPU_MAX_PROMPT_TOKENS}, whose prefill takes tens of seconds on one core)")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="concurrent connections; beyond them uvicorn answers 503 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: new requests get 503 at once, running and queued ones may finish for S "
                   "seconds, then each stream ends with an error event and [DONE], each other request with a 503 "
                   "(default: %(default)s)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="close idle keep-alive connections after S seconds (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request head has not arrived S seconds after it opened or "
                   "after its last response (slowloris) (default: %(default)s)")
    p.add_argument("--malloc-tuning", action=argparse.BooleanOptionalAction, default=True,
                   help="memory settings for a long run: oneDNN's kernel cache capped at 256 shapes and ideep's at "
                   "64, and glibc "
                   "with 2 arenas and free heap pages returned every 64 requests, which lower RSS over a long run "
                   "(docs/reports/reliability.md, Soak); glibc's mmap/trim thresholds stay dynamic (fixed low they "
                   "halved the throughput: docs/serving/malloc.md) (default: on)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core (model, drafter, scheduler) in a process of its own, as vLLM's "
                   "EngineCore, so the HTTP event loop never waits for the engine's hold on the GIL; "
                   "--no-engine-process runs it as a thread of the server (default: on)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens prefilled between two decode steps, so a long prompt delays the other "
                   "streams by one chunk at most; 0 prefills whole prompts (default: %(default)s)")
    p.add_argument("--mix-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="feed each prompt chunk in the decode step's target pass instead of a pass of its own (the "
                   "weights are read once for both, as vLLM's chunked prefill does); greedy text may then depend on "
                   "the load, as the decoding rows go through larger matmuls whose bf16 kernels round some rows "
                   "differently (default: on; --batch-invariant turns it off)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's text does not depend on what else the server runs (the same prompt alone or "
                   "among others gives the same greedy text): each prompt fed in pieces cut at multiples of "
                   "--prefill-chunk from its start, one prompt per pass, no --mix-prefill; docs/architecture.md says "
                   "what holds (default: off, the faster shared and mixed passes)")
    p.add_argument("--kv-reserve", type=count, default=None, metavar="TOKENS",
                   help="positions per slot the target's KV cache holds for all --max-batch + --prefix-cache slots "
                   "from the start (the start-up line says how many bytes), so that a load does not stall on the "
                   "cache's growth, a copy of the whole cache into fresh memory; a longer request still grows it by "
                   f"doubling; 0: start empty and grow on demand (default: {AUTO_KV_RESERVE} or the model's context, "
                   f"fewer when the slots would take more than {KV_RESERVE_BUDGET // 2**30} GiB)")
    p.add_argument("--prefix-cache", type=count, default=None, metavar="N",
                   help="prompts kept after their requests finish (a KV-cache slot each), so that a new prompt "
                   "sharing a prefix with one of them (a system prompt, an earlier turn) prefills only the rest, as "
                   "vLLM's prefix caching; 0: off (default: --max-batch)")
    p.set_defaults(func=_serve)


def set_threads(threads: int | None) -> None:
    """--threads: torch CPU threads; None leaves torch's choice."""
    if threads is not None:
        import torch

        if threads < 1:
            from dspark.errors import DSparkError

            raise DSparkError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def build_engine(args: argparse.Namespace):
    """The ``Engine`` that `dspark serve` runs (target, drafter, verify policy), from its flags; in the engine
    process (``--engine-process``) this runs in the child, so it also applies the threads and allocator
    settings there."""
    from dspark.drafters.registry import load_drafter
    from dspark.errors import ModelLoadError
    from dspark.scheduler.adapter import make_policy, parse_policy
    from dspark.generation.step_profile import load_or_profile_cost
    from dspark.scheduler.sts import load_sts_json
    from dspark.serving.engine import Engine, EngineConfig
    from dspark.serving.memory import freeze_startup_objects

    if args.malloc_tuning:  # before the model is loaded: its tensors and every later one follow the settings
        from dspark.serving.memory import cap_onednn_cache, tune_malloc

        cap_onednn_cache()
        tune_malloc()
    set_threads(getattr(args, "threads", None) or int(os.environ.get("DSPARK_THREADS", "0") or 0) or None)
    target = load_target_from_args(args)
    if target.tokenizer is None:
        raise ModelLoadError(f"{args.target} has no tokenizer; the server needs one to read prompts")
    drafter = load_drafter(args.drafter, target, drafting_options(args))
    sps = None
    if parse_policy(args.policy).needs_sps_table or args.profile_step_cost:
        sps = load_or_profile_cost(args.sps_table, target, drafter, args.max_batch, args.profile_step_cost,
                                   args.drafter)
        print(f"[dspark] alg1/async plan on {describe_cost(sps)}", file=sys.stderr)
    temps = load_sts_json(args.sts, drafter.block_size) if args.sts else None
    policy = make_policy(args.policy, sps, temps, args.fallback_confidence)
    engine = Engine(target, drafter, policy, EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                                          prefill_chunk=args.prefill_chunk or None,
                                                          mix_prefill=args.mix_prefill,
                                                          batch_invariant=args.batch_invariant,
                                                          **kv_settings(args, target)))
    freeze_startup_objects()  # garbage collections scan only what requests allocate (serving.memory)
    return engine


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from dspark.errors import DSparkError
    from dspark.scheduler.adapter import parse_policy
    from dspark.serving.limits import uvicorn_limits
    from dspark.serving.memory import freeze_startup_objects
    from dspark.serving.params import SamplingDefaults
    from dspark.serving.server import ServerConfig, create_app
    from dspark.serving.shutdown import DrainingServer

    if args.prefill_chunk < 0 or args.header_timeout <= 0 or args.shutdown_timeout < 0:
        raise DSparkError("--prefill-chunk and --shutdown-timeout must be >= 0 and --header-timeout > 0")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise DSparkError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise DSparkError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        raise DSparkError(f"--generation-config {args.generation_config!r} is not auto, vllm or a folder")
    parse_policy(args.policy)  # a bad --policy fails here, before any model is loaded
    if args.sps_table and args.profile_step_cost:
        raise DSparkError("give --sps-table (a cost table to load) or --profile-step-cost (a file to profile one "
                          "into), not both")
    if args.engine_process:
        from dspark.serving.engine_process import EngineProcess
        from dspark.target.model import load_tokenizer

        if args.malloc_tuning:
            from dspark.serving.memory import tune_malloc

            tune_malloc()  # this process's own allocations (requests, responses)
        engine = EngineProcess(build_engine, args).start()
        target, tokenizer = engine.target, load_tokenizer(engine.target.path)
    else:
        engine = build_engine(args)
        target, tokenizer = engine.target, engine.target.tokenizer
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or None
    source = {"auto": target.path, "vllm": None}.get(args.generation_config, args.generation_config)
    config = ServerConfig(model_name=args.served_model_name or args.target, api_key=api_key,
                          default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
                          max_prompt_tokens=default_max_prompt_tokens(args.max_prompt_tokens, target),
                          shutdown_timeout_s=args.shutdown_timeout, malloc_trim_every=64 if args.malloc_tuning else 0,
                          sampling_defaults=SamplingDefaults.from_folder(source))
    app = create_app(engine, tokenizer, config)
    freeze_startup_objects()
    print(kv_cache_line(target.kv_bytes_per_token, args.max_batch, target.max_context,
                        **kv_settings(args, target)), file=sys.stderr)
    policy = engine.policy.name if hasattr(engine, "policy") and engine.policy is not None else args.policy
    print(f"[dspark] serving {config.model_name} with drafter {args.drafter}, policy {policy} on "
          f"http://{args.host}:{args.port}/v1{' (API key required)' if api_key else ''}"
          f"{' (engine core in process ' + str(engine.pid) + ')' if args.engine_process else ''}", file=sys.stderr)
    try:
        DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      **uvicorn_limits(args.max_connections, args.keep_alive_timeout,
                                                       args.header_timeout))).run()
    finally:
        engine.stop(0.25)  # idempotent: the app's shutdown stopped it unless uvicorn never started
    # Everything is closed and every client answered. Interpreter teardown with torch and a tokenizer loaded
    # takes ~3 s more here (in C, after main returns), which would break the exit-within-timeout + 2 s
    # promise of --shutdown-timeout, so end the process now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def describe_cost(cost) -> str:
    """What a cost table times, in words (the start-up log)."""
    from dspark.scheduler.step_cost import as_step_cost

    model = as_step_cost(cost)
    if model.verify_only:
        return f"the target's verify pass alone (an SPS table, up to {model.max_batch_tokens} batch tokens)"
    drafter = model.profile.get("drafter") or "the drafter"
    return (f"the whole step: drafting ({drafter}, 1..{model.draft.grid[-1]} requests), the verify pass (up to "
            f"{model.max_batch_tokens} batch tokens) and host work")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def default_kv_reserve(bytes_per_token: int, slots: int, max_context: int) -> int:
    """--kv-reserve's default: AUTO_KV_RESERVE positions (at most the model's context) for each of ``slots``, fewer
    (whole key blocks, at least one) when that would take more than KV_RESERVE_BUDGET bytes."""
    from dspark.modeling.kv_cache import BLOCK

    fit = KV_RESERVE_BUDGET // max(slots * bytes_per_token, 1) // BLOCK * BLOCK
    return max(min(AUTO_KV_RESERVE, max_context, fit), BLOCK)


def kv_settings(args: argparse.Namespace, target) -> dict[str, int]:
    """The engine's ``kv_reserve`` and ``prefix_cache`` from --kv-reserve and --prefix-cache, defaults resolved."""
    prefix_cache = args.max_batch if args.prefix_cache is None else args.prefix_cache
    reserve = args.kv_reserve
    if reserve is None:
        reserve = default_kv_reserve(target.kv_bytes_per_token, args.max_batch + prefix_cache, target.max_context)
    return {"kv_reserve": reserve, "prefix_cache": prefix_cache}


def kv_cache_line(bytes_per_token: int, max_batch: int, max_context: int, kv_reserve: int = 0,
                  prefix_cache: int = 0) -> str:
    """The start-up line that states the KV cache's size: per token, held from the start, and the most it can reach."""
    from dspark.modeling.kv_cache import BLOCK
    from dspark.serving.engine import kv_cache_bound

    slots = max_batch + prefix_cache
    bound = kv_cache_bound(bytes_per_token, max_batch, max_context, prefix_cache)
    held = slots * -(-min(kv_reserve, max_context) // BLOCK) * BLOCK * bytes_per_token
    start = f"{_size(held)} held from the start ({kv_reserve:,} positions x {slots} slots, --kv-reserve); "
    start = start if kv_reserve else ""
    kept = f" and --prefix-cache {prefix_cache}" if prefix_cache else ""
    return (f"[dspark] KV cache: {bytes_per_token:,} bytes per token of a request (2 x layers x KV heads x head dim "
            f"x dtype bytes); {start}at most {_size(bound)} with --max-batch {max_batch}{kept} at the model's "
            f"context of {max_context:,} (requests beyond --max-batch wait in the queue, beyond --max-queue get 429)")


def default_max_prompt_tokens(given: int | None, target) -> int | None:
    """--max-prompt-tokens: as given; else none on a GPU, and CPU_MAX_PROMPT_TOKENS on a CPU."""
    if given is not None or target.device.type != "cpu":
        return given
    return min(CPU_MAX_PROMPT_TOKENS, target.max_context)
