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
from dataclasses import dataclass

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
    p.add_argument("--hybrid", action="store_true",
                   help="hybrid drafting: where the context already contains the last N tokens, draft what followed "
                   "them (prompt lookup), elsewhere the trained drafter; still lossless (default: off)")
    p.add_argument("--hybrid-min-ngram", type=_count, default=3, metavar="N",
                   help="with --hybrid: the shortest repeated n-gram that switches a step to prompt lookup "
                   "(default: %(default)s)")


@dataclass(frozen=True)
class DraftingOptions:
    """How a drafter drafts, built once from a command's flags and passed by name (``load_drafter``).

    ``block_size``: drafts per step (None = the checkpoint's own; prompt lookup 7, a draft LM 4);
    ``head_top_m``: DSpark's sequential head drafts among the top M base tokens (None or 0 = all V);
    ``draft_vocab``: a `dspark data vocab` file, DSpark/DFlash draft only those tokens (None = all V);
    ``hybrid``: draft the context's own continuation (prompt lookup, n-gram >= ``hybrid_min_ngram``) where
    the context repeats itself and the trained drafter elsewhere (``dspark.drafters.hybrid``);
    ``dtype`` / ``compile``: how the target was loaded (the drafter follows the target's dtype).
    Every choice keeps decoding lossless; drafters that have no use for one ignore it.
    """

    block_size: int | None = None
    head_top_m: int | None = None
    draft_vocab: str | None = None
    hybrid: bool = False
    hybrid_min_ngram: int = 3
    dtype: str = "float32"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.head_top_m is not None and self.head_top_m < 0:
            raise ValueError(f"head_top_m must be >= 0, got {self.head_top_m}")
        if self.hybrid_min_ngram < 1:
            raise ValueError(f"hybrid_min_ngram must be >= 1, got {self.hybrid_min_ngram}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "DraftingOptions":
        """The options a command's parsed flags ask for (flags the command does not have keep the defaults)."""
        values = {name: getattr(args, name) for name in cls.__dataclass_fields__ if getattr(args, name, None) is not None}
        return cls(**{**values, **overrides})


def load_target_from_args(args: argparse.Namespace, tokenizer: bool = True):
    """``load_target(args.target)`` with ``--dtype`` and ``--compile`` applied."""
    from dspark.target.model import load_target

    target = load_target(args.target, dtype=torch_dtype(getattr(args, "dtype", "float32")), tokenizer=tokenizer,
                         fuse=True)  # decoding only: q/k/v and gate/up as one matmul each
    if getattr(args, "compile", False):
        from dspark.modeling.compile import compile_decoder

        compile_decoder(target.model)
    return target
