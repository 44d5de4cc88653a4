"""Reading checkpoint folders safely: safetensors first, ``torch.load`` only with weights_only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.errors import ModelLoadError


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json: expected a Hugging Face model folder")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8 at all
        raise ModelLoadError(f"{path} is not valid JSON ({err}); restore the model's config.json") from None
    except OSError as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model folder (single or sharded safetensors, or .bin as a fallback)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    loader = load_file
    if not files:
        files = sorted(folder.glob("pytorch_model*.bin"))
        loader = lambda f: torch.load(f, map_location="cpu", weights_only=True)  # noqa: E731
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors (or pytorch_model*.bin) weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(loader(f))
        except Exception as err:  # corrupt or truncated file
            raise ModelLoadError(f"cannot read weights from {f}: {err}") from None
    return state


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, allow_missing=()) -> None:
    """Copy ``state`` into ``module`` with clear errors on missing keys and shape mismatches."""
    own = module.state_dict()
    missing = [k for k in own if k not in state and not any(k.startswith(a) for a in allow_missing)]
    if missing:
        raise ModelLoadError(f"{what}: weights missing from the checkpoint: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for k, v in own.items():
        if k in state and state[k].shape != v.shape:
            raise ModelLoadError(f"{what}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    module.load_state_dict({k: state[k] for k in own if k in state}, strict=False)
