"""DecoderSpec: the architecture facts our decoder needs, read from an HF config.

Supported families: Llama (incl. SmolLM), Mistral, Qwen2, Qwen3, Gemma, Gemma2,
Gemma3 (text). Anything else is refused with a clear error rather than run
with silently wrong maths. Fields a ``config.json`` leaves out take the
defaults of the family's transformers config class (``_FAMILY_DEFAULTS``), and
family quirks follow the transformers modeling code:

- Llama: q/k/v/o biases from ``attention_bias``, MLP biases from ``mlp_bias``; no windows.
- Mistral: no biases; ``sliding_window`` (default 4096) applies to every layer.
- Qwen2: q/k/v always biased, o never; windows only with ``use_sliding_window``,
  on layers >= ``max_window_layers``.
- Qwen3: q/k/v/o biases from ``attention_bias``; RMSNorm on q and k; windows as Qwen2.
- Gemma: RMSNorm scales by (1 + weight), embeddings times sqrt(hidden), ``gelu`` means tanh-GELU.
- Gemma2/3: sandwich norms, ``query_pre_attn_scalar`` scale, soft-capping, alternating
  sliding/full layers; Gemma3 adds q/k norms and a separate RoPE for sliding layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark.errors import ModelLoadError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3")


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
    attention_bias: bool = False  # bias on q_proj, k_proj, v_proj
    attention_out_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate/up/down_proj (Llama's mlp_bias)
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

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes the KV cache holds per position of one request: keys and values of every layer,
        2 x layers x KV heads x head dim x bytes per element (``KVPool.bytes_per_token`` of its pool)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def rope_for(self, layer_idx: int) -> RopeSpec:
        return self.rope[self.layer_types[layer_idx]]

    def window_for(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


@dataclass(frozen=True)
class _Defaults:
    """transformers 5 config-class defaults for the fields a config.json may omit."""

    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_kv_heads: int | None = None  # None: num_attention_heads
    max_positions: int = 2048
    act_field: str = "hidden_act"  # Gemma2/3 read `hidden_activation`
    act: str = "silu"
    tie: bool = False
    sliding_window: int | None = None
    rope_theta: float = 10000.0


_FAMILY_DEFAULTS = {
    "llama": _Defaults(),
    "mistral": _Defaults(num_kv_heads=8, max_positions=131072, sliding_window=4096),
    "qwen2": _Defaults(num_kv_heads=32, max_positions=32768, sliding_window=4096),
    "qwen3": _Defaults(head_dim=128, num_kv_heads=32, max_positions=32768, sliding_window=4096),
    "gemma": _Defaults(head_dim=256, num_kv_heads=16, max_positions=8192, act="gelu_pytorch_tanh", tie=True),
    "gemma2": _Defaults(head_dim=256, num_kv_heads=4, max_positions=8192, act_field="hidden_activation",
                        act="gelu_pytorch_tanh", tie=True, sliding_window=4096),
    "gemma3_text": _Defaults(head_dim=256, num_kv_heads=4, max_positions=131072, act_field="hidden_activation",
                             act="gelu_pytorch_tanh", tie=True, sliding_window=4096, rope_theta=1e6),
}
_GEMMA3_LOCAL_THETA = 10000.0  # Gemma3 sliding layers' RoPE base when the config does not say


def _get(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]`` if present (even when null), else ``default`` (transformers' kwarg semantics)."""
    return cfg[key] if key in cfg else default


def _rope_spec(params: dict[str, Any] | None, default_theta: float, max_positions: int) -> RopeSpec:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    theta = params.get("rope_theta")
    return RopeSpec(
        theta=float(default_theta if theta is None else theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings") or max_positions),
    )


def _layer_types(cfg: dict[str, Any], model_type: str, num_layers: int, window: int | None) -> list[str]:
    explicit = cfg.get("layer_types")
    if model_type in ("llama", "gemma"):  # these classes have no windows at all
        return ["full_attention"] * num_layers
    if model_type == "mistral":  # Mistral ignores layer_types: its window (if any) covers every layer
        return ["sliding_attention" if window is not None else "full_attention"] * num_layers
    if explicit:
        if len(explicit) < num_layers or any(t not in LAYER_TYPES for t in explicit):
            raise ModelLoadError(
                f"config.json layer_types must list {num_layers} entries out of {', '.join(LAYER_TYPES)}"
            )
        return list(explicit)[:num_layers]
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    # qwen2 / qwen3: windows only on layers >= max_window_layers, and only when enabled
    first = int(_get(cfg, "max_window_layers", 28))
    return ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]


def _ropes(cfg: dict[str, Any], model_type: str, layer_types: list[str], max_positions: int) -> dict[str, RopeSpec]:
    theta = _get(cfg, "rope_theta", _FAMILY_DEFAULTS[model_type].rope_theta)
    if model_type == "gemma3_text":  # nested per layer type; legacy rope_scaling targets full attention
        nested = cfg.get("rope_parameters") or {}
        full = {**(nested.get("full_attention") or {}), **(cfg.get("rope_scaling") or {})}
        local = _get(cfg, "rope_local_base_freq", _GEMMA3_LOCAL_THETA)
        return {"full_attention": _rope_spec(full, theta, max_positions),
                "sliding_attention": _rope_spec(nested.get("sliding_attention"), local, max_positions)}
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if any(isinstance(params.get(t), dict) for t in LAYER_TYPES):  # one set per layer type
        ropes = {t: _rope_spec(params[t], theta, max_positions) for t in LAYER_TYPES if params.get(t)}
        missing = set(layer_types) - set(ropes)
        if missing:
            raise ModelLoadError(f"rope_parameters has no entry for layer type(s) {sorted(missing)}")
        return ropes
    one = _rope_spec(params, theta, max_positions)
    return {t: one for t in LAYER_TYPES}


def spec_from_config(cfg: dict[str, Any]) -> DecoderSpec:
    """Build a DecoderSpec from an HF ``config.json`` dict."""
    if not isinstance(cfg, dict):
        raise ModelLoadError("config.json must hold a JSON object")
    if "text_config" in cfg and cfg.get("model_type") not in SUPPORTED:  # e.g. Gemma3ForConditionalGeneration
        text = dict(cfg["text_config"] or {})
        if cfg.get("model_type") == "gemma3":
            text.setdefault("model_type", "gemma3_text")
        cfg = text
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported; supported families: {', '.join(SUPPORTED)}"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{model_type} with use_bidirectional_attention is an encoder, not a causal LM")
    d = _FAMILY_DEFAULTS[model_type]
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        num_kv_heads = int(_get(cfg, "num_key_value_heads", d.num_kv_heads) or num_heads)
        head_dim = int(_get(cfg, "head_dim", d.head_dim) or hidden // num_heads)
        max_positions = int(_get(cfg, "max_position_embeddings", d.max_positions))
        act = _get(cfg, d.act_field, d.act) or d.act
        if model_type == "gemma" and act == "gelu":  # transformers: legacy Gemma value meaning tanh-GELU
            act = "gelu_pytorch_tanh"
        if model_type == "mistral":
            window = _get(cfg, "sliding_window", d.sliding_window)
        elif model_type in ("qwen2", "qwen3"):
            window = _get(cfg, "sliding_window", d.sliding_window) if cfg.get("use_sliding_window") else None
        else:
            window = _get(cfg, "sliding_window", d.sliding_window)
        window = int(window) if window else None
        bias = bool(cfg.get("attention_bias", False))
        spec = DecoderSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
            hidden_act=act,
            attention_bias={"mistral": False, "qwen2": True}.get(model_type, bias),
            attention_out_bias=False if model_type in ("mistral", "qwen2") else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", d.tie)),
            max_position_embeddings=max_positions,
            sliding_window=window,
        )
        spec.layer_types = _layer_types(cfg, model_type, num_layers, window)
        spec.rope = _ropes(cfg, model_type, spec.layer_types, max_positions)
        if model_type in ("gemma2", "gemma3_text"):
            spec.sandwich_norms = True
            spec.attn_scale = float(_get(cfg, "query_pre_attn_scalar", 256)) ** -0.5
            softcaps = (50.0, 30.0) if model_type == "gemma2" else (None, None)
            spec.attn_softcap = _get(cfg, "attn_logit_softcapping", softcaps[0])
            spec.final_softcap = _get(cfg, "final_logit_softcapping", softcaps[1])
    except KeyError as err:
        raise ModelLoadError(f"config.json lacks the field {err}") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise ModelLoadError(f"config.json has a malformed field: {err}") from None
    if spec.hidden_act not in ACTIVATIONS:
        raise ModelLoadError(f"activation {spec.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if spec.num_heads % spec.num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads ({spec.num_heads}) is not a multiple of num_key_value_heads ({spec.num_kv_heads})"
        )
    if model_type in ("qwen3", "gemma3_text"):
        spec.qk_norm = True
    if model_type.startswith("gemma"):
        spec.norm_offset = 1.0
        spec.embed_scale = math.sqrt(hidden)
    return spec
