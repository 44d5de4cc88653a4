"""The ``dspark`` command line. Each subsystem registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dspark.errors import DSparkError

# modules exposing ``add_cli(subparsers)``; a missing optional one is skipped
_COMMAND_MODULES = (
    "dspark.target.cli",
    "dspark.generation.cli",
    "dspark.data.cli",
    "dspark.training.cli",
    "dspark.evaluation.cli",
    "dspark.scheduler.cli",
    "dspark.serving.cli",
    "dspark.bench.speed",
    "dspark.studies.reproduce",
    "dspark.studies.demo",
)


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
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                continue
            raise
        module.add_cli(sub)
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
