"""Command-line options shared by the decoding commands (generate, eval, calibrate, profile, serve, demo, bench).

``--dtype`` / ``--compile`` say how the target is loaded; the drafter follows the
target's dtype (its loaders cast to it), so one flag sets both. bfloat16 changes
the target itself: greedy output is the bf16 target's, which can differ from the
float32 target's after a while. Lossless still means "the same distribution as
this target". ``--head-top-m`` says how a DSpark drafter drafts.

No torch import at module level: building the parsers must stay fast for ``--help``.
"""

from __future__ import annotations

import argparse

DTYPE_NAMES = ("float32", "bfloat16")


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def add_target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="weights and compute dtype of target and drafter; bfloat16 halves the memory read per "
                   "step and is much faster on CPUs with bf16 matmul units (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's decoder layers (inductor; the first steps compile for "
                   "tens of seconds; docs/performance-variants.md measures what it gains)")


def add_drafter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head-top-m", type=_count, default=None, metavar="M",
                   help="DSpark's sequential head drafts among the top M tokens of the backbone's logits U_k "
                   "instead of all V: skips its V x r product per drafted token (about 2x cheaper drafting for "
                   "SmolLM2); still lossless, acceptance barely changes; 0 = all V, the trained head (default: all V)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="DSpark/DFlash draft only the tokens of this `dspark data vocab` file: their base logits "
                   "use those LM-head rows only (default: the whole vocabulary)")


def load_target_from_args(args: argparse.Namespace, tokenizer: bool = True):
    """``load_target(args.target)`` with ``--dtype`` and ``--compile`` applied."""
    from dspark.target.model import load_target

    target = load_target(args.target, dtype=torch_dtype(getattr(args, "dtype", "float32")), tokenizer=tokenizer,
                         fuse=True)  # decoding only: q/k/v and gate/up as one matmul each
    if getattr(args, "compile", False):
        from dspark.modeling.compile import compile_decoder

        compile_decoder(target.model)
    return target
