"""How a drafter drafts (``DraftingOptions``), chosen once per command or ``dspark.load`` call.

The flags that fill it in (``--head-top-m``, ``--draft-vocab``, ``--hybrid``, ...) live in
``dspark.cli_options``; nothing here knows about argparse.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.target.loading import DTYPE_NAMES


@dataclass(frozen=True)
class DraftingOptions:
    """How a drafter drafts, built once from a command's flags and passed by name (``load_drafter``).

    ``block_size``: drafts per step (None = the checkpoint's own; prompt lookup 7, a draft LM 4);
    ``head_top_m``: DSpark's sequential head drafts among the top M base tokens (None or 0 = all V);
    ``draft_vocab``: a `dspark data vocab` file, DSpark/DFlash/Eagle3 draft only those tokens (None = all V);
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
