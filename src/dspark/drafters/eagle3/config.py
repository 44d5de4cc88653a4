"""Eagle3 settings (DeepSpec names, docs/interop.md §Eagle3)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dspark.drafters.checkpoint import check_layer_ids


@dataclass
class Eagle3Config:
    ttt_length: int = 7  # training-time-test steps
    step_loss_decay: float = 0.8  # weight of step s is decay ** s
    draft_num_hidden_layers: int = 1
    target_layer_ids: list[int] | None = None  # None: target.default_layer_ids()
    block_size: int = 7  # drafts per step at inference (chain length)

    def __post_init__(self) -> None:
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if not 0.0 < self.step_loss_decay <= 1.0:
            raise ValueError(f"step_loss_decay must be in (0, 1], got {self.step_loss_decay}")
        if self.draft_num_hidden_layers < 1:
            raise ValueError(f"draft_num_hidden_layers must be >= 1, got {self.draft_num_hidden_layers}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            check_layer_ids(self.target_layer_ids)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Eagle3Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Eagle3 config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
