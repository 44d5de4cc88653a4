"""Decoder building blocks shared by the target and the drafters.

Module and parameter names follow Hugging Face (``self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm`` ...), so HF and DeepSpec state dicts
load without renaming.

Shapes: N = tokens (flattened over requests), H = hidden size, Hq / Hkv =
query / KV heads, D = head dim, S = key length.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from dspark.modeling import cpu_kernels
from dspark.modeling.spec import DecoderSpec, RopeSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma multiplies in float32 before casting back
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:  # (D/2,)
    """Inverse frequencies, computed in float32 step for step as transformers does (bitwise equal)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # (D/2,)
    inv = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":  # Llama 3.1: scale low frequencies, interpolate the middle band
        old = rope.original_max_position_embeddings
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_tables(
    positions: torch.Tensor,  # (N,) int64
    inv_freq: torch.Tensor,  # (D/2,)
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin (N, 1, D) float32
    """cos and sin of every position, as transformers computes them (float32)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (N, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (N, D)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # (N, heads, D), (N, 1, D) x2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_rope(
    x: torch.Tensor,  # (N, heads, D)
    positions: torch.Tensor,  # (N,) int64
    inv_freq: torch.Tensor,  # (D/2,)
) -> torch.Tensor:  # (N, heads, D)
    return rotate(x, *rope_tables(positions, inv_freq))


#: what the projections take for RoPE: the positions (N,), or their precomputed (cos, sin) from ``Rope``
RopeInput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class Rope:
    """The RoPE tables of one forward pass: cos/sin computed once per distinct RoPE setting and dtype,
    then shared by every layer (instead of recomputed in each layer's q and k projections)."""

    def __init__(self, positions: torch.Tensor) -> None:  # (N,) int64
        self.positions = positions
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def for_layer(self, attn: "Attention", dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # (N, 1, D) x2
        key = (attn.rope_key, dtype)
        if key not in self._tables:
            cos, sin = rope_tables(self.positions, attn.inv_freq)
            self._tables[key] = (cos.to(dtype), sin.to(dtype))
        return self._tables[key]


_ACT = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        h, m, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, m, bias=bias)
        self.up_proj = nn.Linear(h, m, bias=bias)
        self.down_proj = nn.Linear(m, h, bias=bias)
        self.act = _ACT[spec.hidden_act]
        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections (inference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, H)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (N, M) each
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections and norms; attending is done by the caller (cache-aware)."""

    def __init__(self, spec: DecoderSpec, layer_idx: int, in_features: int | None = None) -> None:
        super().__init__()
        h, d = in_features or spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.attention_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.attention_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.attention_bias)
        self.o_proj = nn.Linear(spec.num_heads * d, spec.hidden_size, bias=spec.attention_out_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.scale = spec.scale
        self.softcap = spec.attn_softcap
        self.window = spec.window_for(layer_idx)
        rope = spec.rope_for(layer_idx)
        self.register_buffer("inv_freq", rope_inv_freq(rope, d), persistent=False)
        self.rope_key = (tuple(dataclasses.astuple(rope)), d)  # layers with equal keys share RoPE tables
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections (inference)
        self.kv_proj: nn.Linear | None = None  # k/v as one matmul: set by fuse_draft_projections (drafters' context)

    def project_q(self, x: torch.Tensor, positions: RopeInput) -> torch.Tensor:  # (N, Hq, D)
        return self._finish_q(self.q_proj(x), positions)

    def project_kv(self, x: torch.Tensor, positions: RopeInput) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_proj is not None:
            k, v = self.kv_proj(x).chunk(2, dim=-1)  # (N, Hkv*D) each
            return self._finish_kv(k, v, positions)
        return self._finish_kv(self.k_proj(x), self.v_proj(x), positions)

    def project_qkv(
        self, x: torch.Tensor, positions: RopeInput  # (N, H), (N,) or Rope.for_layer's (cos, sin)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q (N, Hq, D), k and v (N, Hkv, D)
        if self.qkv_proj is None:
            return (self.project_q(x, positions), *self.project_kv(x, positions))
        kv = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        return (self._finish_q(q, positions), *self._finish_kv(k, v, positions))

    def project_qkv_fused(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]  # (N, H) normed, (N, 1, D) x2 bf16
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q (N, Hq, D), k and v (N, Hkv, D): views of one buffer
        """``project_qkv`` through the fused CPU kernels: one projection, RoPE in place on its q and k heads."""
        N, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (N, (Hq + 2 Hkv) D)
        cos, sin = (t.reshape(N, D) for t in cos_sin)
        cpu_kernels.rope_(qkv, cos, sin, Hq + Hkv, D)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        return q.view(N, Hq, D), k.view(N, Hkv, D), v.view(N, Hkv, D)

    def _cos_sin(self, positions: RopeInput) -> tuple[torch.Tensor, torch.Tensor]:  # (N, 1, D) x2
        return rope_tables(positions, self.inv_freq) if isinstance(positions, torch.Tensor) else positions

    def _finish_q(self, q: torch.Tensor, positions: RopeInput) -> torch.Tensor:  # (N, Hq*D) -> (N, Hq, D)
        q = q.reshape(q.shape[0], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rotate(q, *self._cos_sin(positions))

    def _finish_kv(
        self, k: torch.Tensor, v: torch.Tensor, positions: RopeInput  # (N, Hkv*D) x2
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (N, Hkv, D) x2
        k = k.reshape(k.shape[0], self.num_kv_heads, self.head_dim)
        v = v.reshape(v.shape[0], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rotate(k, *self._cos_sin(positions)), v

    def attend(
        self,
        q: torch.Tensor,  # (Hq, T, D)
        k: torch.Tensor,  # (Hkv, S, D)
        v: torch.Tensor,  # (Hkv, S, D)
        mask: torch.Tensor | None,  # (T, S) bool, True = may attend; None = all
    ) -> torch.Tensor:  # (T, Hq*D)
        groups = self.num_heads // self.num_kv_heads
        T, S = q.shape[1], k.shape[1]
        # SDPA (fused kernels) on a GPU always, on the CPU for long query blocks (prefill) only
        if self.softcap is None and (q.is_cuda or T > 16):
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=self.scale, enable_gqa=groups > 1
            )[0]  # (Hq, T, D)
        else:  # CPU decode/verify blocks: grouped matmuls, no K/V repeat (faster than SDPA on CPU here)
            qg = q.reshape(self.num_kv_heads, groups * T, self.head_dim)  # (Hkv, g*T, D)
            scores = (qg @ k.transpose(-1, -2)) * self.scale  # (Hkv, g*T, S)
            if self.softcap is not None:  # Gemma2 soft-capping
                scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.view(self.num_kv_heads, groups, T, S)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(self.num_kv_heads, groups * T, S)
            out = (probs @ v).view(self.num_heads, T, self.head_dim)
        return out.transpose(0, 1).reshape(q.shape[1], -1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        eps, off = spec.rms_norm_eps, spec.norm_offset
        self.self_attn = Attention(spec, layer_idx)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, off)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, off)
        self.sandwich = spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, off)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, off)

    def pre_attention(
        self, x: torch.Tensor, positions: RopeInput  # (N, H), (N,) or (cos, sin) (N, 1, D) x2
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q (N, Hq, D), k and v (N, Hkv, D)
        """Norm, projections and RoPE: the dense part before attention (what ``--compile`` compiles)."""
        return self.self_attn.project_qkv(self.input_layernorm(x), positions)

    def post_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:  # (N, H), (N, Hq*D)
        """Output projection, both residual branches and the MLP: the dense part after attention."""
        return self.mlp_residual(self.attn_residual(x, attn_out))

    def post_attention_fused(
        self, x: torch.Tensor, attn_out: torch.Tensor, following: RMSNorm  # (N, H), (N, Hq*D)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x after the layer (N, H), following(x) (N, H)
        """``post_attention`` through the fused CPU kernels, ending with the norm that reads the result (the next
        layer's input norm, or the final norm): each residual add and the norm after it are one pass."""
        norm = self.post_attention_layernorm
        x, h = cpu_kernels.add_rms_norm(x, self.self_attn.o_proj(attn_out), norm.weight, norm.eps)
        mlp = self.mlp.down_proj(cpu_kernels.silu_mul(self.mlp.gate_up_proj(h)))
        return cpu_kernels.add_rms_norm(x, mlp, following.weight, following.eps)

    def attn_residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Add the attention branch (after o_proj) to the residual stream."""
        branch = self.self_attn.o_proj(attn_out)
        if self.sandwich:
            return x + self.post_attention_layernorm(branch)
        return x + branch

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        if self.sandwich:
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.mlp(self.post_attention_layernorm(x))


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of ``parts``' outputs."""
    w = torch.cat([p.weight for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(w)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    fused.requires_grad_(False)
    return fused


def fuse_projections(layers: nn.ModuleList) -> None:
    """Inference: q/k/v and gate/up as one matmul each (fewer, larger matmuls are faster on CPU).

    The separate projections are dropped (their weights live on in the fused ones), so a fused model's
    state_dict no longer has checkpoint names: fuse only models that are not saved or trained.
    """
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        if a.qkv_proj is None:
            a.qkv_proj = _fused_linear([a.q_proj, a.k_proj, a.v_proj])
            del a.q_proj, a.k_proj, a.v_proj
        if m.gate_up_proj is None:
            m.gate_up_proj = _fused_linear([m.gate_proj, m.up_proj])
            del m.gate_proj, m.up_proj


def fuse_draft_projections(layers: nn.ModuleList) -> None:
    """``fuse_projections`` for a drafter's layers, whose keys and values are also projected from the context
    alone (``DSparkModel.context_kv``): q/k/v, k/v and gate/up as one matmul each, the separate ones dropped.
    Inference only, as ``fuse_projections``."""
    for layer in layers:
        a = layer.self_attn
        if a.kv_proj is None and a.qkv_proj is None:
            a.kv_proj = _fused_linear([a.k_proj, a.v_proj])
    fuse_projections(layers)
