"""Helpers shared by the trainable drafters (DSpark/DFlash, Eagle3): configs and checkpoints.

Checkpoints use DeepSpec's layout (docs/interop.md §Drafter checkpoints): ``model.safetensors`` with
no ``model.`` prefix and a ``config.json`` that is a copy of the target's HF
config with ``architectures``, ``num_hidden_layers`` (the draft's) and the
draft's own keys added at the top level.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.errors import IncompatibleModelsError, ModelLoadError
from dspark.modeling.spec import SUPPORTED, DecoderSpec
from dspark.modeling.weights import load_state_dict, read_config


def check_layer_ids(layer_ids: list[int], num_target_layers: int | None = None) -> None:
    """Target layer ids must be decoder layers (>= 0), strictly increasing, inside the target."""
    if not layer_ids:
        raise ValueError("target_layer_ids must not be empty")
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
        raise ValueError(f"target_layer_ids must be strictly increasing, got {layer_ids}")
    if layer_ids[0] < 0:
        raise ValueError(
            f"target_layer_ids {layer_ids}: -1 (the embedding output) is not supported; use decoder layers 0.."
        )
    if num_target_layers is not None and layer_ids[-1] >= num_target_layers:
        raise ValueError(f"target_layer_ids {layer_ids} exceed the target's {num_target_layers} layers")



_ARCH_PREFIX = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama", "mistral": "Mistral",
                "gemma": "Gemma", "gemma2": "Gemma2", "gemma3_text": "Gemma3"}


def arch_name(model_type: str, suffix: str) -> str:
    """``Qwen3DSparkModel`` for a Qwen3 target (DeepSpec), ``LlamaDSparkModel`` for Llama, ..."""
    return f"{_ARCH_PREFIX.get(model_type, 'Generic')}{suffix}"


def arch_names(suffix: str) -> tuple[str, ...]:
    """Every name ``arch_name`` gives with ``suffix`` (for the registry's table)."""
    return tuple(f"{prefix}{suffix}" for prefix in (*_ARCH_PREFIX.values(), "Generic"))


def spec_to_hf_config(spec: DecoderSpec) -> dict[str, Any]:
    """An HF-style config dict that ``spec_from_config`` turns back into ``spec`` (for targets without a folder)."""
    cfg: dict[str, Any] = {
        "model_type": spec.model_type, "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size, "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": spec.hidden_act, "attention_bias": spec.attention_bias, "mlp_bias": spec.mlp_bias,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "max_position_embeddings": spec.max_position_embeddings, "layer_types": list(spec.layer_types),
        "sliding_window": spec.sliding_window, "use_sliding_window": spec.sliding_window is not None,
    }
    if spec.model_type.startswith("gemma"):
        cfg["hidden_activation"] = spec.hidden_act
    if spec.model_type in ("gemma2", "gemma3_text"):
        cfg["query_pre_attn_scalar"] = spec.scale**-2
        cfg["attn_logit_softcapping"] = spec.attn_softcap
        cfg["final_logit_softcapping"] = spec.final_softcap
    ropes = {t: dataclasses.asdict(r) for t, r in spec.rope.items()}
    for r in ropes.values():
        r["rope_theta"] = r.pop("theta")
    full = ropes["full_attention"]
    cfg["rope_theta"] = full["rope_theta"]
    if spec.model_type == "gemma3_text":
        cfg["rope_local_base_freq"] = ropes["sliding_attention"]["rope_theta"]
        cfg["rope_parameters"] = ropes
    elif all(r == full for r in ropes.values()):
        cfg["rope_parameters"] = full
    else:
        cfg["rope_parameters"] = ropes
    return cfg


def target_base_config(target) -> dict[str, Any]:
    """The target's HF config (DeepSpec deep-copies it into the draft's config.json), else one built from its spec."""
    path = getattr(target, "path", None)
    if path is not None and (Path(path) / "config.json").is_file():
        cfg = read_config(Path(path))
        if "text_config" in cfg and cfg.get("model_type") not in SUPPORTED:
            cfg = dict(cfg["text_config"])
        cfg = copy.deepcopy(cfg)
        for key in ("auto_map", "quantization_config", "_name_or_path", "_model_name_or_path"):
            cfg.pop(key, None)
        return cfg
    return spec_to_hf_config(target.spec)


#: ``draft_layer`` values: "target" = the target family's layer, "qwen3" = Qwen3's whatever the target
DRAFT_LAYERS = ("target", "qwen3")


def draft_spec_from(target_spec: DecoderSpec, num_layers: int, draft_layer: str = "target") -> DecoderSpec:
    """The target's architecture with ``num_layers`` full-attention layers and an untied head.

    ``draft_layer="qwen3"``: Qwen3-shaped layers whatever the target family (q/k RMSNorm, SiLU, plain RMSNorm,
    pre-norm, no soft-capping, unscaled embeddings), the sizes and RoPE of the target's full-attention layers.
    That is what SGLang's ``Qwen3DSparkModel`` and vLLM's ``DFlashDraftModel`` / DSpark classes build for a
    drafter of any target (docs/interop.md §Draft layers)."""
    if draft_layer not in DRAFT_LAYERS:
        raise ValueError(f"draft_layer must be one of {DRAFT_LAYERS}, got {draft_layer!r}")
    spec = dataclasses.replace(
        target_spec, num_layers=num_layers, layer_types=["full_attention"] * num_layers,
        tie_word_embeddings=False, rope=dict(target_spec.rope),
    )
    if draft_layer == "qwen3" and target_spec.model_type != "qwen3":
        full = target_spec.rope["full_attention"]
        spec = dataclasses.replace(
            spec, model_type="qwen3", hidden_act="silu", attention_bias=False, attention_out_bias=False, mlp_bias=False,
            qk_norm=True, norm_offset=0.0, embed_scale=1.0, sandwich_norms=False, attn_scale=None,
            attn_softcap=None, final_softcap=None, sliding_window=None, rope={t: full for t in spec.rope},
        )
    return spec


#: target config keys a Qwen3-shaped draft's config.json keeps (the rest describes the target's own layers)
_QWEN3_KEEP = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "torch_dtype", "dtype",
               "transformers_version")


def qwen3_base_config(target_base: dict[str, Any], draft_spec: DecoderSpec, target_spec: DecoderSpec
                      ) -> dict[str, Any]:
    """config.json base of a ``draft_layer="qwen3"`` drafter: a Qwen3 config of the draft's sizes (so
    ``spec_from_config`` reads the draft's layers back, and the engines see ``model_type: qwen3``), the target's
    token ids, and what the draft must know of the target: its family and the soft-cap of its logits (the target
    distribution p_t passes through it; the draft's own logits do not)."""
    cfg = {k: target_base[k] for k in _QWEN3_KEEP if k in target_base}
    cfg.update(spec_to_hf_config(draft_spec))
    cfg.update({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                "target_model_type": target_spec.model_type})
    if target_spec.final_softcap:
        cfg["target_final_logit_softcapping"] = target_spec.final_softcap
    return cfg


#: the frozen tensors a drafter shares with its target (a checkpoint may leave them out)
FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")


def write_checkpoint(folder: Path, state: dict[str, torch.Tensor], config: dict[str, Any],
                     dtype: torch.dtype) -> None:
    """``model.safetensors`` + ``config.json`` (DeepSpec layout); the caller makes it atomic.
    Floating tensors are written as ``dtype``, integer ones (a draft vocabulary) as they are."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous().clone()
               for k, v in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def checkpoint_keys(folder: Path) -> set[str]:
    """The tensor names of a drafter folder, any ``model.`` prefix removed (reads only the header of a single
    ``model.safetensors``)."""
    path = Path(folder) / "model.safetensors"
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return {k.removeprefix("model.") for k in f.keys()}
    return set(read_checkpoint_state(folder))


def read_checkpoint_state(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a drafter folder, floating ones in float32, any ``model.`` prefix removed."""
    state = load_state_dict(Path(folder))
    return {k.removeprefix("model."): v.float() if v.is_floating_point() else v for k, v in state.items()}


def check_target_fit(what: str, *, hidden_size: int, vocab_size: int, target_layer_ids: list[int],
                     num_target_layers: int | None, target) -> None:
    """Raise IncompatibleModelsError when a drafter checkpoint cannot serve ``target``."""
    problems = []
    if hidden_size != target.hidden_size:
        problems.append(f"hidden size {hidden_size} vs the target's {target.hidden_size}")
    if vocab_size != target.vocab_size:
        problems.append(f"vocabulary {vocab_size} vs the target's {target.vocab_size}")
    if num_target_layers is not None and num_target_layers != target.num_layers:
        problems.append(f"it was trained on a target with {num_target_layers} layers, this one has {target.num_layers}")
    bad = [i for i in target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} do not exist in a {target.num_layers}-layer target")
    if problems:
        raise IncompatibleModelsError(
            f"{what} does not fit the target {getattr(target, 'name', '')!r}: " + "; ".join(problems)
            + ". Use the target the drafter was trained for, or train a drafter for this target."
        )


def load_drafter_weights(model: nn.Module, folder: Path, what: str, target=None) -> nn.Module:
    """Load a drafter checkpoint's tensors into ``model``; returns it in float32 with embeddings frozen.

    A checkpoint without ``embed_tokens`` / ``lm_head`` (drafts that share the target's, e.g. SpecForge's)
    takes them from ``target``.
    """
    from dspark.modeling.weights import load_into

    state = read_checkpoint_state(folder)
    frozen = FROZEN_PREFIXES
    if target is not None and "lm_head.weight" in state and state["lm_head.weight"].shape == target.model.lm_head.weight.shape:
        check_fingerprint(what, head_fingerprint(state["lm_head.weight"]), target, "its lm_head")
    load_into(model, state, what, allow_missing=frozen if target is not None else ())
    if target is not None and any(f"{p}weight" not in state for p in frozen):
        copy_frozen_embeddings(model, target)
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    return model.float()


def copy_frozen_embeddings(model: nn.Module, target) -> None:
    """Copy the target's input embedding and LM head into ``model`` and freeze them (shared, never trained).
    A model with a ``draft_vocab`` gets the LM head's rows over it only."""
    vocab = getattr(model, "draft_vocab", None)
    head = target.model.lm_head.weight
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.model.embed_tokens.weight)
        model.lm_head.weight.copy_(head if vocab is None else head[vocab.to(head.device)])
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)


def init_weights(module: nn.Module, std: float, generator: torch.Generator | None) -> None:
    """HF-style init: Linear/Embedding ~ N(0, std), zero biases; norms keep their ones/zeros."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std, generator=generator)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def finish_new_drafter(model: nn.Module, target, base: dict[str, Any], generator: torch.Generator | None) -> nn.Module:
    """A new drafter made ready to train: random init of its own weights (std = the target's initializer_range),
    the target's embedding and LM head copied in and frozen, cast to the target's dtype."""
    init_weights(model, float(base.get("initializer_range", 0.02)), generator)
    copy_frozen_embeddings(model, target)
    return model.to(device=target.device, dtype=target.dtype)


# ---------------------------------------------------------------- draft vocabulary and target fingerprint

def check_draft_vocab(ids: torch.Tensor | list[int], vocab_size: int, what: str = "draft vocabulary") -> torch.Tensor:
    """The draft vocabulary as a (W,) int64 tensor: distinct target ids in [0, vocab_size), at least one."""
    t = torch.as_tensor(ids)
    if t.is_floating_point() or t.dim() != 1 or t.numel() == 0:
        raise IncompatibleModelsError(f"{what}: expected a non-empty 1-D list of token ids, got {tuple(t.shape)} {t.dtype}")
    t = t.long()
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        raise IncompatibleModelsError(
            f"{what}: token id {hi if hi >= vocab_size else lo} is outside the target vocabulary of {vocab_size}; "
            "it was built for another tokenizer")
    if torch.unique(t).numel() != t.numel():
        raise IncompatibleModelsError(f"{what}: token ids repeat")
    return t.cpu()


def fill_restricted(out: nn.Module, model: nn.Module, ids: torch.Tensor, row_keys: tuple[str, ...]) -> nn.Module:
    """``out`` (a fresh copy of ``model``'s architecture built with draft vocabulary ``ids``, (W,)) given ``model``'s
    weights, the ``row_keys`` tensors cut to the W rows (V, .) -> (W, .); on ``model``'s device and dtype, with its
    trainable flags and mode."""
    weight = model.lm_head.weight
    state = model.state_dict()
    for key in row_keys:
        if key in state:
            state[key] = state[key][ids.to(weight.device)]  # (V, .) -> (W, .)
    state["draft_vocab"] = ids
    out.load_state_dict(state)
    out = out.to(device=weight.device, dtype=weight.dtype)
    for p, q in zip(out.parameters(), model.parameters()):
        p.requires_grad_(q.requires_grad)
    return out.train(model.training)


def vocab_index(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:  # (W,) -> (V,) int64: id -> w, -1 outside
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[ids] = torch.arange(ids.numel())
    return index


def read_draft_vocab(folder: Path, config: dict[str, Any], vocab_size: int) -> torch.Tensor | None:
    """The (W,) ``draft_vocab`` tensor of a checkpoint whose config.json has ``draft_vocab_size`` (else None)."""
    from safetensors import safe_open

    size = config.get("draft_vocab_size")
    path = Path(folder) / "model.safetensors"
    try:
        with safe_open(str(path), "pt") as f:
            ids = f.get_tensor("draft_vocab") if "draft_vocab" in f.keys() else None
    except Exception:  # no single safetensors file (sharded, .bin, corrupt): the weight loader reports it
        ids = None
    if size is None:
        if ids is not None:
            raise ModelLoadError(f"{path} holds a draft_vocab tensor but {folder}/config.json has no draft_vocab_size")
        return None
    if ids is None:
        raise ModelLoadError(f"{folder}/config.json says draft_vocab_size {size} but {path} has no draft_vocab tensor")
    if ids.numel() != int(size):
        raise ModelLoadError(f"{path}: draft_vocab has {ids.numel()} ids, config.json says draft_vocab_size {size}")
    return check_draft_vocab(ids, vocab_size, f"{path} draft_vocab")


#: rows x columns of the LM head kept as a target's fingerprint
_FP_ROWS, _FP_COLS = 8, 8


def head_fingerprint(weight: torch.Tensor) -> list[float]:  # (V, H) LM head -> 64 numbers
    """A few LM-head values that tell targets (and tokenizers) apart; equal across fp32 / bf16 copies."""
    V = weight.shape[0]
    rows = weight.detach()[[V * j // _FP_ROWS for j in range(_FP_ROWS)], :_FP_COLS]
    return [round(float(x), 6) for x in rows.float().flatten()]


def target_fingerprint(target) -> list[float]:
    return head_fingerprint(target.model.lm_head.weight)


def check_fingerprint(what: str, fingerprint: list[float] | None, target, source: str = "config.json") -> None:
    """IncompatibleModelsError when ``fingerprint`` (None = unknown, not checked) is not ``target``'s."""
    if not fingerprint:
        return
    mine = torch.tensor(target_fingerprint(target))
    theirs = torch.tensor([float(x) for x in fingerprint])
    # bf16 rounding moves each value by < 0.4 %; another target's head differs by about 100 %
    if theirs.shape != mine.shape or float((theirs - mine).abs().mean()) > 0.02 * float(mine.abs().mean()) + 1e-6:
        raise IncompatibleModelsError(
            f"{what} was trained for another target or tokenizer ({source}: its LM-head fingerprint differs from "
            f"{getattr(target, 'name', '')!r}'s); use the target it was trained for, or train a drafter for this one")
