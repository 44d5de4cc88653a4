"""Command-line options shared by the decoding commands (generate, eval, calibrate, profile, serve, demo, bench).

``--device`` / ``--dtype`` / ``--compile`` say how the target is loaded; the drafter
follows the target's device and dtype (its loaders move it there), so one flag sets
both. ``--device`` defaults to cuda when a GPU is available, else cpu; ``--dtype``
to bfloat16 on cuda and float32 on cpu (``resolve_device``, ``default_dtype_name``). bfloat16 changes
the target itself: greedy output is the bf16 target's, which can differ from the
float32 target's after a while. Lossless still means "the same distribution as
this target". ``--head-top-m`` says how a DSpark drafter drafts.

No torch import at module level: building the parsers must stay fast for ``--help``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DTYPE_NAMES = ("float32", "bfloat16")
DEVICE_NAMES = ("auto", "cpu", "cuda")  # one GPU of many: CUDA_VISIBLE_DEVICES


def resolve_device(name: str | None = "auto") -> str:
    """``--device`` (or a training config's ``device``) as "cpu" or "cuda": auto (or None) = cuda when a GPU
    is available, else cpu. Asking for cuda where torch sees no GPU is a user error (``DSparkError``)."""
    import torch

    from dspark.errors import DSparkError

    name = name or "auto"
    if name not in DEVICE_NAMES:
        raise DSparkError(f"--device {name!r}: expected one of {', '.join(DEVICE_NAMES)}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DSparkError(f"--device cuda: no CUDA GPU is available to torch {torch.__version__} here; "
                          "use --device cpu")
    return name


def default_dtype_name(device: str) -> str:
    """bfloat16 on a GPU (what its tensor cores run), float32 on the CPU (bitwise-comparable with HF)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _count(text: str) -> int:
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
    p.add_argument("--head-top-m", type=_count, default=None, metavar="M",
                   help="DSpark's sequential head drafts among the top M tokens of the backbone's logits U_k "
                   "instead of all V: skips its V x r product per drafted token (about 2x cheaper drafting for "
                   "SmolLM2); still lossless, acceptance barely changes; 0 = all V, the trained head (default: all V)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="DSpark/DFlash draft only the tokens of this `dspark data vocab` file: their base logits "
                   "use those LM-head rows only (default: the whole vocabulary)")
    p.add_argument("--hybrid", action="store_true",
                   help="hybrid drafting: where the context already contains its last N tokens, draft what followed "
                   "them (prompt lookup); where only a shorter n-gram repeats, prompt lookup while its running "
                   "acceptance pays more than the trained drafter's, else the trained drafter; still lossless "
                   "(default: off)")
    p.add_argument("--hybrid-min-ngram", type=_positive, default=3, metavar="N",
                   help="with --hybrid: the shortest repeated n-gram that is always drafted by prompt lookup; 1 = "
                   "every repeat, without the adaptive choice (default: %(default)s)")


@dataclass(frozen=True)
class DraftingOptions:
    """How a drafter drafts, built once from a command's flags and passed by name (``load_drafter``).

    ``block_size``: drafts per step (None = the checkpoint's own; prompt lookup 7, a draft LM 4);
    ``head_top_m``: DSpark's sequential head drafts among the top M base tokens (None or 0 = all V);
    ``draft_vocab``: a `dspark data vocab` file, DSpark/DFlash draft only those tokens (None = all V);
    ``hybrid``: draft the context's own continuation (prompt lookup, n-gram >= ``hybrid_min_ngram``) where
    the context repeats itself and the trained drafter elsewhere (``dspark.drafters.hybrid``);
    ``dtype`` / ``compile``: how the target was loaded (the drafter follows the target's device and dtype).
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


def resolve_target_args(args: argparse.Namespace) -> tuple[str, str]:
    """Fill in ``args.device`` and ``args.dtype`` (auto / unset -> this machine's defaults); returns both."""
    args.device = resolve_device(getattr(args, "device", None))
    args.dtype = getattr(args, "dtype", None) or default_dtype_name(args.device)
    return args.device, args.dtype


def load_decoding_target(name_or_path: str, device: str | None = "auto", dtype: str | None = None,
                         compile: bool = False, tokenizer: bool = True):
    """The target as every decoding command loads it (the CLI through ``load_target_from_args``, ``dspark.load``
    directly): on ``device`` (auto = cuda when a GPU is available), in ``dtype`` (None = bfloat16 on cuda,
    float32 on cpu), in the decoding layout (q/k/v and gate/up fused, weights prepacked unless ``compile``) with
    one-token steps computed as verify blocks compute their rows (``batch_invariant``), ``torch.compile``d
    decoder layers with ``compile``. ``dspark.target.model.load_target``'s own defaults are the plain layout."""
    from dspark.errors import DSparkError
    from dspark.target.model import load_target

    device = resolve_device(device)
    dtype = dtype or default_dtype_name(device)
    if dtype not in DTYPE_NAMES:
        raise DSparkError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_NAMES)}")
    target = load_target(name_or_path, dtype=torch_dtype(dtype), tokenizer=tokenizer, device=device,
                         fuse=True, batch_invariant=True, pack=not compile)
    if compile:
        from dspark.modeling.compile import compile_decoder

        compile_decoder(target.model)
    return target


def load_target_from_args(args: argparse.Namespace, tokenizer: bool = True):
    """``load_decoding_target(args.target)`` with ``--device``, ``--dtype`` and ``--compile`` applied (``args.device``
    and ``args.dtype`` are resolved in place, so later readers see what was loaded)."""
    device, dtype = resolve_target_args(args)
    return load_decoding_target(args.target, device, dtype, getattr(args, "compile", False), tokenizer)
