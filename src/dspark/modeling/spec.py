"""DecoderSpec: the architecture facts our decoder needs, read from an HF config.

Supported families: Llama (incl. SmolLM, Mistral), Qwen2, Qwen3, Gemma, Gemma2,
Gemma3 (text). Anything else is refused with a clear error rather than run
with silently wrong maths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dspark.errors import ModelLoadError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


@dataclass
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class DecoderSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma3: RMSNorm over head_dim on q and k before RoPE
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + weight)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    sandwich_norms: bool = False  # Gemma2/3: pre/post feed-forward norms, post-attention norm on the branch
    attn_scale: float | None = None  # None = head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention"
    rope: dict[str, RopeSpec] = field(default_factory=dict)  # per layer type
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def rope_for(self, layer_idx: int) -> RopeSpec:
        return self.rope[self.layer_types[layer_idx]]

    def window_for(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


def _rope_spec(params: dict[str, Any] | None, default_theta: float) -> RopeSpec:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
    return RopeSpec(
        theta=float(params.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def spec_from_config(cfg: dict[str, Any]) -> DecoderSpec:
    """Build a DecoderSpec from an HF ``config.json`` dict."""
    if "text_config" in cfg and cfg.get("model_type") not in SUPPORTED:
        cfg = {**cfg["text_config"]}
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported; supported families: {', '.join(SUPPORTED)}"
        )
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        spec = DecoderSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type.startswith("gemma"))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        )
    except KeyError as err:
        raise ModelLoadError(f"config.json lacks the field {err}") from None
    if model_type in ("qwen3", "gemma3_text"):
        spec.qk_norm = True
    if model_type.startswith("gemma"):
        spec.norm_offset = 1.0
        spec.embed_scale = math.sqrt(hidden)
        if spec.hidden_act == "gelu":
            spec.hidden_act = "gelu_pytorch_tanh"
    if model_type in ("gemma2", "gemma3_text"):
        spec.sandwich_norms = True
        spec.attn_scale = float(cfg.get("query_pre_attn_scalar", spec.head_dim)) ** -0.5
        spec.attn_softcap = cfg.get("attn_logit_softcapping")
        spec.final_softcap = cfg.get("final_logit_softcapping")
    # sliding windows: explicit layer_types win; Mistral/Qwen2 use one window for all layers when enabled
    spec.sliding_window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if not layer_types:
        if model_type == "gemma2":
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)]
        elif model_type == "gemma3_text":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(spec.num_layers)
            ]
        elif spec.sliding_window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            layer_types = ["sliding_attention"] * spec.num_layers
        else:
            layer_types = ["full_attention"] * spec.num_layers
    spec.layer_types = list(layer_types)[: spec.num_layers]
    # RoPE: transformers 5 `rope_parameters` (maybe per layer type) or legacy rope_theta/rope_scaling
    theta = float(cfg.get("rope_theta", 10000.0))
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        spec.rope = {k: _rope_spec(v, theta) for k, v in params.items()}
    else:
        spec.rope = {"full_attention": _rope_spec(params, theta)}
        local = cfg.get("rope_local_base_freq")
        spec.rope["sliding_attention"] = RopeSpec(theta=float(local)) if local else spec.rope["full_attention"]
    for t in set(spec.layer_types):
        if t not in spec.rope:
            spec.rope[t] = spec.rope.get("full_attention", RopeSpec(theta=theta))
    return spec
