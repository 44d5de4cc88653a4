"""Convert a GGUF preset once into an ordinary Hugging Face folder.

A GGUF-loaded model cannot be saved directly (its config carries a
``quantization_config``), so we dequantise, rebuild the model from a clean
config, load the state dict and save safetensors + tokenizer.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from dspark.errors import ModelLoadError
from dspark.extras import require
from dspark.target.presets import PRESETS, GGUFPreset


def convert_gguf_preset(preset: GGUFPreset, out_dir: Path | None = None) -> Path:
    """Write the HF folder for ``preset`` (atomically) and return its path."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir or preset.cache_dir())
    if (out_dir / "config.json").is_file():
        return out_dir
    require("gguf", "gguf", f"converting the GGUF preset {preset.name}")
    gguf = preset.gguf_path()
    print(f"[dspark] converting {gguf.name} to a Hugging Face folder in {out_dir} (once)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["_name_or_path"] = preset.name
    config = AutoConfig.for_model(**config_dict)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ModelLoadError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        clean.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        gen = model.generation_config.to_dict()
        (tmp / "generation_config.json").write_text(json.dumps(
            {k: gen[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in gen}, indent=2))
        try:
            tmp.rename(out_dir)
        except OSError:  # another process (a second shard on a fresh machine) converted it first: use its folder
            if not (out_dir / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_model_path(name_or_path: str) -> Path:
    """A preset name (converted on first use) or a local Hugging Face folder."""
    if name_or_path in PRESETS:
        return convert_gguf_preset(PRESETS[name_or_path])
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor an existing folder"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: expected a Hugging Face model folder")
    return path
