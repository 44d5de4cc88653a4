"""Command-line options shared by the decoding commands (generate, eval, calibrate, profile, serve, demo, bench).

``--device`` / ``--dtype`` / ``--compile`` say how the target is loaded (``dspark.target.loading``); the drafter
follows the target's device and dtype, so one flag sets both. ``--head-top-m``, ``--draft-vocab`` and
``--hybrid`` say how a drafter drafts (``dspark.drafters.options.DraftingOptions``). The library keeps what
these flags choose; this module only maps flags onto it.

No torch import at module level: building the parsers must stay fast for ``--help``.
"""

from __future__ import annotations

import argparse

from dspark.drafters.options import DraftingOptions
from dspark.target.loading import DEVICE_NAMES, DTYPE_NAMES, default_dtype_name, load_decoding_target, resolve_device


def positive(text: str) -> int:
    """argparse ``type``: a whole number >= 1."""
    value = count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def count(text: str) -> int:
    """argparse ``type``: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def add_device_option(p: argparse.ArgumentParser, default: str | None = "auto", help: str | None = None) -> None:
    p.add_argument("--device", choices=DEVICE_NAMES, default=default,
                   help=help or "where the target and the drafter run (default: auto = cuda when a GPU is "
                   "available, else cpu)")


def add_dtype_option(p: argparse.ArgumentParser, what: str = "target and drafter") -> None:
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help=f"weights and compute dtype of {what}; bfloat16 halves the memory read per step and is "
                   "much faster on GPUs and on CPUs with bf16 matmul units (default: bfloat16 on cuda, float32 "
                   "on cpu)")


def add_target_options(p: argparse.ArgumentParser) -> None:
    add_device_option(p)
    add_dtype_option(p)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's decoder layers (inductor; the first steps compile for "
                   "tens of seconds; docs/reports/performance.md measures what it gains)")


def add_drafter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head-top-m", type=count, default=None, metavar="M",
                   help="DSpark's sequential head drafts among the top M tokens of the backbone's logits U_k "
                   "instead of all V: skips its V x r product per drafted token (about 2x cheaper drafting for "
                   "SmolLM2); still lossless, acceptance barely changes; 0 = all V, the trained head (default: all V)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="DSpark/DFlash/Eagle3 draft only the tokens of this `dspark data vocab` file: their "
                   "logits use those LM-head rows only (default: the checkpoint's own, or the whole vocabulary)")
    p.add_argument("--hybrid", action="store_true",
                   help="hybrid drafting: where the context already contains its last N tokens, draft what followed "
                   "them (prompt lookup); where only a shorter n-gram repeats, prompt lookup while its running "
                   "acceptance pays more than the trained drafter's, else the trained drafter; still lossless "
                   "(default: off)")
    p.add_argument("--hybrid-min-ngram", type=positive, default=3, metavar="N",
                   help="with --hybrid: the shortest repeated n-gram that is always drafted by prompt lookup; 1 = "
                   "every repeat, without the adaptive choice (default: %(default)s)")


def drafting_options(args: argparse.Namespace, **overrides) -> DraftingOptions:
    """The ``DraftingOptions`` a command's parsed flags ask for (flags the command does not have keep the
    defaults); ``overrides`` win over the flags."""
    fields = DraftingOptions.__dataclass_fields__
    values = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    return DraftingOptions(**{**values, **overrides})


def resolve_target_args(args: argparse.Namespace) -> tuple[str, str]:
    """Fill in ``args.device`` and ``args.dtype`` (auto / unset -> this machine's defaults); returns both."""
    args.device = resolve_device(getattr(args, "device", None))
    args.dtype = getattr(args, "dtype", None) or default_dtype_name(args.device)
    return args.device, args.dtype


def load_target_from_args(args: argparse.Namespace, tokenizer: bool = True):
    """``load_decoding_target(args.target)`` with ``--device``, ``--dtype`` and ``--compile`` applied (``args.device``
    and ``args.dtype`` are resolved in place, so later readers see what was loaded)."""
    device, dtype = resolve_target_args(args)
    return load_decoding_target(args.target, device, dtype, getattr(args, "compile", False), tokenizer)
