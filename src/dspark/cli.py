"""The ``dspark`` command line: every command and every command group is registered here, once.

Each subsystem defines the flags of its own commands (``add_cli`` and friends); this module decides which
commands exist, in which order ``dspark --help`` lists them, and builds the ``bench`` group.
"""

from __future__ import annotations

import argparse
import os
import sys

from dspark.bench import cli as bench_cli
from dspark.data import cli as data_cli
from dspark.errors import DSparkError
from dspark.evaluation import cli as evaluation_cli
from dspark.export import cli as export_cli
from dspark.generation import cli as generation_cli
from dspark.generation import profile_cli
from dspark.serving import cli as serving_cli
from dspark.simulate import cli as simulate_cli
from dspark.studies import cli as studies_cli
from dspark.target import cli as target_cli
from dspark.training import cli as training_cli


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (`dspark bench serve`: serving load test)",
                       description="Benchmarks; see `dspark bench COMMAND --help`.")
    bench = p.add_subparsers(dest="bench_command", metavar="COMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    bench_cli.add_serve(bench)
    bench_cli.add_speed(bench)
    bench_cli.add_chaos(bench)
    bench_cli.add_train(bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark",
        description="Lossless speculative decoding: prepare a target, build data, train DSpark/DFlash/Eagle3 "
        "drafters, calibrate, evaluate, generate, profile, serve and load-test.",
    )
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: $DSPARK_THREADS or torch's default); 1 is fastest "
                        "when other jobs share the CPU")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    target_cli.add_cli(sub)  # prepare
    generation_cli.add_cli(sub)  # generate
    data_cli.add_cli(sub)  # data {prompts, regenerate, tokenize, features, vocab}
    training_cli.add_cli(sub)  # train
    export_cli.add_cli(sub)  # export --to sglang|vllm|vocab (and export-vocab, deprecated)
    evaluation_cli.add_cli(sub)  # eval, calibrate
    studies_cli.add_reproduce(sub)  # reproduce
    profile_cli.add_cli(sub)  # profile
    serving_cli.add_cli(sub)  # serve
    simulate_cli.add_cli(sub)  # simulate
    _add_bench(sub)  # bench {serve, speed}
    studies_cli.add_demo(sub)  # demo
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    threads = args.threads or int(os.environ.get("DSPARK_THREADS", "0") or 0)
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        return int(args.func(args) or 0)
    except DSparkError as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
