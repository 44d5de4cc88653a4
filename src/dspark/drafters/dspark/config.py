"""DSpark / DFlash settings: the config dataclass and how it is read back from a checkpoint's config.json.

DFlash is DSpark without the sequential and confidence heads (``DSparkConfig.dflash()``).
Names follow DeepSpec (docs/interop.md §Drafter checkpoints, docs/interop.md §Training configs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.drafters.checkpoint import DRAFT_LAYERS, check_layer_ids
from dspark.errors import ModelLoadError

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # heads.py


@dataclass
class DSparkConfig:
    """DSpark drafter and training settings (DeepSpec names). ``DSparkConfig.dflash()`` gives DFlash."""

    block_size: int = 7
    num_draft_layers: int = 1
    target_layer_ids: list[int] | None = None  # None: target.default_layer_ids()
    # None: the first embedding row past the tokenizer if the vocabulary has spare rows (DeepSpec's
    # choice for Qwen3), else the tokenizer's unk token, else its pad token unless that is a stop
    # token, else vocab_size - 1. See resolve_mask_token_id.
    mask_token_id: int | None = None
    num_anchors: int = 64  # DeepSpec uses 512 on GPUs; 64 keeps CPU memory modest
    markov_rank: int = 256  # 0 = no sequential head (DFlash)
    markov_head_type: str = "vanilla"  # "vanilla" eq. (5) | "gated" (DeepSpec) | "rnn" eq. (6)
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    loss_decay_gamma: float = 4.0
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    confidence_head_alpha: float = 1.0
    # 0: slot k predicts anchor + k + 1 (DeepSpec's); 1: slot k predicts anchor + k and slot 0 drafts nothing
    # (z-lab / SpecForge DFlash, vLLM's DFlash, speculators DSpark): gamma = block_size - 1 drafts
    # (docs/interop.md §Slot conventions, ``slot_offset_of``)
    slot_offset: int = 0
    # "qwen3" (default): Qwen3-shaped layers (q/k RMSNorm, SiLU) for any target, what SGLang's and vLLM's
    # DSpark/DFlash classes load; "target": layers of the target's family (docs/interop.md §Draft layers)
    draft_layer: str = "qwen3"

    def __post_init__(self) -> None:
        if self.draft_layer not in DRAFT_LAYERS:
            raise ValueError(f"draft_layer must be one of {DRAFT_LAYERS}, got {self.draft_layer!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.slot_offset not in (0, 1) or self.block_size <= self.slot_offset:
            raise ValueError(f"slot_offset must be 0 or 1 and below block_size {self.block_size}, got {self.slot_offset}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = no sequential head), got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "confidence_head_with_markov needs a Markov head (markov_rank > 0); "
                "set confidence_head_with_markov=False or enable_confidence_head=False"
            )
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            check_layer_ids(self.target_layer_ids)
        for name in ("ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def dflash(cls, **overrides: Any) -> "DSparkConfig":
        """DFlash: the same backbone, no sequential head, no confidence head, CE only (docs/interop.md §Training configs)."""
        base = dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False,
                    ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)
        return cls.from_dict({**base, **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DSparkConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown DSpark config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def num_drafts(self) -> int:
        """Drafts one block proposes: every slot, or all but slot 0 for an anchor + k checkpoint."""
        return self.block_size - self.slot_offset

    @property
    def is_dflash(self) -> bool:
        return self.markov_rank == 0 and not self.enable_confidence_head


def resolve_mask_token_id(target) -> int:
    """A token id for the block's mask slots (see ``DSparkConfig.mask_token_id``)."""
    V = target.vocab_size
    tok = target.tokenizer
    if tok is None:
        return V - 1
    if len(tok) < V:  # a spare embedding row nothing ever produces (DeepSpec: 151669 for Qwen3)
        return len(tok)
    stops = set(target.eos_token_ids)
    for cand in (tok.unk_token_id, tok.pad_token_id):
        if cand is not None and 0 <= cand < V and cand not in stops:
            return int(cand)
    return V - 1


# keys of config.json that belong to the draft, not to the copied target config
DRAFT_KEYS = {
    "architectures", "num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "num_anchors",
    "enable_confidence_head", "markov_rank", "markov_head_type", "confidence_head_with_markov",
    "loss_decay_gamma", "ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha", "dflash_config",
    "torch_dtype", "dtype", "draft_vocab_size", "target_fingerprint", "speculators_model_type", "draft_layer",
    "slot_offset",
}

#: ``architectures[0]`` of checkpoints whose slot k predicts anchor + k (z-lab's and SpecForge's DFlash)
ANCHOR_PLUS_K_ARCHITECTURES = ("DFlashDraftModel",)


def slot_offset_of(cfg: dict[str, Any]) -> int:
    """The slot convention of a checkpoint's config.json (docs/interop.md §Slot conventions): 0 when slot k
    predicts anchor + k + 1 (DeepSpec's ``*DSparkModel``, ours), 1 when slot k predicts anchor + k with slot 0
    unused (``DFlashDraftModel`` of z-lab and SpecForge, the speculators format's ``speculators_model_type:
    "dspark"``)."""
    arch = (cfg.get("architectures") or [""])[0]
    return int(arch in ANCHOR_PLUS_K_ARCHITECTURES or cfg.get("speculators_model_type") == "dspark"
               or cfg.get("slot_offset") == 1)  # ours: hf_config writes slot_offset


def config_from_checkpoint(cfg: dict[str, Any], folder: Path | str = "") -> DSparkConfig:
    """DSparkConfig from a DeepSpec config.json (top-level keys; SpecForge's ``dflash_config`` also read)."""
    nested = cfg.get("dflash_config") or {}

    def get(key: str, default: Any = None) -> Any:
        return cfg.get(key, nested.get(key, default))

    for key in ("block_size", "target_layer_ids", "mask_token_id"):
        if get(key) is None:
            raise ModelLoadError(f"{folder}/config.json lacks {key!r}: not a DSpark/DFlash checkpoint")
    rank = int(get("markov_rank", 0) or 0)
    conf = bool(get("enable_confidence_head", False))
    defaults = DSparkConfig() if rank > 0 or conf else DSparkConfig.dflash()
    try:
        return DSparkConfig(
            block_size=int(get("block_size")),
            num_draft_layers=int(cfg["num_hidden_layers"]),
            target_layer_ids=[int(i) for i in get("target_layer_ids")],
            mask_token_id=int(get("mask_token_id")),
            num_anchors=int(get("num_anchors", defaults.num_anchors)),
            markov_rank=rank,
            markov_head_type=str(get("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=conf,
            confidence_head_with_markov=bool(get("confidence_head_with_markov", False)) and conf,
            loss_decay_gamma=float(get("loss_decay_gamma", defaults.loss_decay_gamma)),
            ce_loss_alpha=float(get("ce_loss_alpha", defaults.ce_loss_alpha)),
            l1_loss_alpha=float(get("l1_loss_alpha", defaults.l1_loss_alpha)),
            confidence_head_alpha=float(get("confidence_head_alpha", defaults.confidence_head_alpha)),
            slot_offset=slot_offset_of(cfg),
            draft_layer=str(cfg.get("draft_layer", "target")),
        )
    except (ValueError, KeyError) as err:
        raise ModelLoadError(f"{folder}/config.json: invalid DSpark settings ({err})") from None
