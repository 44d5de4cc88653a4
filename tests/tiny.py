"""Tiny random-weight models for fast tests (seconds on CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dspark.modeling.decoder import CausalLM
from dspark.modeling.spec import spec_from_config
from dspark.target.model import TargetModel

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0,
}


def tiny_config(**overrides) -> dict:
    return {**TINY_LLAMA, **overrides}


def tiny_target(seed: int = 0, sharp: float = 4.0, **overrides) -> TargetModel:
    """A random target. ``sharp`` scales the LM head so distributions are peaked, like a real LM's."""
    torch.manual_seed(seed)
    cfg = tiny_config(**overrides)
    model = CausalLM(spec_from_config(cfg))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)
    return TargetModel(model, None, "tiny", None, [cfg["eos_token_id"]], cfg["max_position_embeddings"])


def save_hf_folder(path: Path, cfg: dict, seed: int = 0) -> Path:
    """Write a real HF folder (transformers' own class) for loader tests."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A word-level tokenizer with ``vocab_size`` entries (w0, w1, ..., [UNK]) saved into an HF folder."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    return Path(folder)


def smollm2_unavailable(reason: str):
    """Skip the calling test, which needs SmolLM2; in CI (CI=true) fail it: there SmolLM2 must be prepared, so a
    missing one is a broken install, not a reason for the test to check nothing."""
    import pytest

    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and SmolLM2 cannot be prepared ({reason}); run `dspark prepare`", pytrace=False)
    pytest.skip(f"SmolLM2 unavailable: {reason}")


def save_chat_target(folder: Path, **overrides) -> tuple[Path, object]:
    """A tiny random HF Llama folder carrying SmolLM2's tokenizer (vocabulary 49,152), and that tokenizer.

    Skips the calling test when SmolLM2 has not been prepared on this machine (fails it in CI)."""
    from transformers import AutoTokenizer

    from dspark.errors import DSparkError
    from dspark.target.convert import resolve_model_path

    try:
        source = resolve_model_path("smollm2-135m")
    except DSparkError as err:
        smollm2_unavailable(str(err))
    tokenizer = AutoTokenizer.from_pretrained(source)
    save_hf_folder(folder, tiny_config(vocab_size=49152, eos_token_id=tokenizer.eos_token_id,
                                       bos_token_id=tokenizer.bos_token_id, **overrides))
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def smollm2_tokenizer():
    """SmolLM2's real tokenizer (and chat template); skips the calling test when it is not prepared (fails it in CI)."""
    from dspark.errors import ModelLoadError
    from dspark.target.convert import resolve_model_path
    from dspark.target.model import load_tokenizer

    try:
        return load_tokenizer(resolve_model_path("smollm2-135m"))
    except ModelLoadError as err:
        smollm2_unavailable(str(err))


def tiny_smollm2_target(context: int = 4096, **overrides) -> TargetModel:
    """A tiny random target with SmolLM2's vocabulary behind SmolLM2's real tokenizer: the real text path in seconds."""
    kw = dict(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=context, eos_token_id=2)
    target = tiny_target(**{**kw, **overrides})
    target.tokenizer = smollm2_tokenizer()
    return target
