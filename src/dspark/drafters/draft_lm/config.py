"""Settings of the distilled independent draft LM (``--set model.num_layers=4`` etc.)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class DraftLMConfig:
    """Settings of the distilled draft LM (``--set model.num_layers=4`` etc.)."""

    num_layers: int = 4  # draft decoder layers; the first num_layers target layers unless layer_ids is set
    layer_ids: list[int] | None = None  # target layers to copy, in order (overrides num_layers)
    freeze_embeddings: bool = True  # keep embed_tokens and lm_head frozen (the target's)
    ce_loss_alpha: float = 0.0  # weight of the hard-label cross-entropy added to the KL
    # draft tokens per step (gamma) when decoding with it, as for the other drafters; recorded in config.json
    # (dspark_draft_lm.block_size) for `dspark bench speed`; `--block-size` overrides it elsewhere
    block_size: int = 7

    def __post_init__(self) -> None:
        if self.layer_ids is not None:
            self.layer_ids = [int(i) for i in self.layer_ids]
            if not self.layer_ids:
                raise ValueError("layer_ids must not be empty (or leave it null to copy the first num_layers)")
            if any(i < 0 for i in self.layer_ids) or len(set(self.layer_ids)) != len(self.layer_ids):
                raise ValueError(f"layer_ids must be distinct target layer indices >= 0, got {self.layer_ids}")
            self.num_layers = len(self.layer_ids)
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.ce_loss_alpha < 0:
            raise ValueError(f"ce_loss_alpha must be >= 0, got {self.ce_loss_alpha}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def source_layers(self, num_target_layers: int) -> list[int]:
        """The target layers the draft copies, checked against the target's depth."""
        ids = self.layer_ids if self.layer_ids is not None else list(range(self.num_layers))
        if max(ids) >= num_target_layers:
            raise ValueError(
                f"the draft LM needs target layers {ids} but the target has {num_target_layers}; "
                "lower model.num_layers or fix model.layer_ids"
            )
        return ids

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
