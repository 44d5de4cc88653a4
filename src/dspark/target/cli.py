"""`dspark prepare`: convert/check a target once."""

from __future__ import annotations

import argparse

from dspark.target.presets import DEFAULT_TARGET, PRESETS


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare", help="convert a preset target (GGUF in a pip package) into a cached HF folder and check it loads",
        description=f"Presets: {', '.join(PRESETS)}. The cache root is $DSPARK_HOME (default ~/.cache/dspark).",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset name or local HF folder (default: %(default)s)")
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from dspark.target.model import load_target

    t = load_target(args.target)
    s = t.spec
    print(f"{args.target}: {t.path}\n  {s.model_type}, {s.num_layers} layers, hidden {s.hidden_size}, "
          f"vocab {s.vocab_size}, eos {t.eos_token_ids}, default target_layer_ids {t.default_layer_ids()}")
    return 0
