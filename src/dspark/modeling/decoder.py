"""A causal decoder that runs a flattened, variable-length batch.

Requests are concatenated along the token axis (N = Σ n_r); linear layers run
once over all tokens, and attention runs once per layer for the whole batch over
the requests' KV caches, slots of one ``KVPool`` (``dspark.modeling.attention``).
This is the shape of a verify step in serving: every request contributes
1 + verify_len tokens to one forward pass.

Batch invariance (``batch_invariant``, CPU bfloat16): oneDNN computes a
one-row matmul (a GEMV) with another reduction order than a matmul of two or
more rows, whose rows all come out bitwise equal from 2 to 32 rows (docs/reports/matmul-regimes.md). A
one-token decode step and a verify block then round differently, so a greedy
near-tie can flip between plain and speculative decoding. With the flag on, a
forward or logits call of exactly one row runs on that row repeated (twice; in
bf16 4 times, the rows a packed linear pads a small product to anyway, so that
no layer pads it again) and keeps one: every row is computed as a verify block
computes it. The price is paid
by steps of one row only (plain decoding, a step with no drafts): about 13 %
of such a step with prepacked bf16 weights on SmolLM2
(docs/reports/performance-packing.md). ``TargetModel.batch_invariance_holds`` checks the
property on the model itself.

Fused CPU kernels (``cpu_kernels``, bfloat16 decoding in the fused layout): each layer's RMSNorms, RoPE, residual
adds and SiLU product run as C loops (``dspark.modeling.cpu_kernels``) instead of a chain of small torch ops,
the residual add and the next layer's norm in one pass; the same rounding as the torch ops, row by row. Where the
head dim suits it (``attention_kernel``), attention too: one C call per layer for the decode and verify rows of
every request (``cpu_kernels.attention``); the prompt pieces a caller names (``prompt_from``) keep torch's fused
attention where it is faster on long query blocks (CPUs with AMX tiles), and join the C call elsewhere
(``cpu_kernels.prompts_to_kernel``).

Shapes: N = tokens in the batch, H = hidden size, V = vocabulary,
F = len(capture_layers) * H.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.modeling import cpu_kernels, packed
from dspark.modeling.attention import BatchLayout, attend_parts, plan_forward
from dspark.modeling.kv_cache import KVCache, KVPool
from dspark.modeling.layers import DecoderLayer, RMSNorm, Rope
from dspark.modeling.spec import DecoderSpec


def causal_mask(
    q_positions: torch.Tensor,  # (T,) absolute positions of the queries
    kv_len: int,
    window: int | None,
) -> torch.Tensor | None:  # (T, S) bool or None when every query may see every key
    if q_positions.numel() == 1 and window is None:
        return None
    k_pos = torch.arange(kv_len, device=q_positions.device)
    mask = k_pos[None, :] <= q_positions[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_positions[:, None] - window
    return mask


class Decoder(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        self.batch_invariant = False  # run a lone row repeated (see the module docstring)
        self.attention = "batched"  # or "per-request": the reference loop (benchmarks)
        self.cpu_kernels = False  # bf16 rows without gradients through dspark.modeling.cpu_kernels (use_cpu_kernels)
        self.attention_kernel = False  # and their attention through cpu_kernels.attention (use_cpu_kernels)

    def use_cpu_kernels(self, on: bool = True) -> bool:
        """Turn the fused CPU kernels on where this model can take them (the fused layout, plain RMSNorms, SiLU,
        no q/k norms or sandwich norms) and they are built here; returns whether they are on."""
        s = self.spec
        fits = (cpu_kernels.layers_fit(s) and not s.qk_norm
                and all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
                        for layer in self.layers))
        self.cpu_kernels = bool(on and fits and cpu_kernels.available())
        self.attention_kernel = self.cpu_kernels and cpu_kernels.attention_fits(self.layers[0].self_attn)
        if self.attention_kernel:
            cpu_kernels.prompts_to_kernel()  # a bad DSPARK_PROMPT_ATTENTION stops the load, not the first prompt
        return self.cpu_kernels

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, H)
        x = self.embed_tokens(input_ids)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale).to(x.dtype)  # float32 first, as transformers rounds it
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) int64, requests concatenated
        seq_lens: list[int],  # tokens per request, sums to N
        caches: list[KVCache] | None = None,  # one per request; None = fresh sequences, no cache
        capture_layers: list[int] | None = None,  # layer ids whose outputs to return
        prompt_from: int | None = None,  # requests from this index on are prompt pieces (None: none)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # last_hidden (N, H) final-normed, features (N, F) or None
        if caches is not None:
            for cache, n in zip(caches, seq_lens):
                cache.reserve(n)  # may grow the pool: before any layer reads it
        fused = (self.cpu_kernels and self.embed_tokens.weight.dtype == torch.bfloat16
                 and input_ids.device.type == "cpu" and not torch.is_grad_enabled())
        # decoding rows through the C kernel when fused; prompt pieces too or through SDPA (prompts_to_kernel)
        parts, layout = plan_forward(seq_lens, caches, input_ids.device, per_request=self.attention == "per-request",
                                     kernel=fused and self.attention_kernel, prompt_from=prompt_from)
        positions = layout.positions  # (N,)
        N = input_ids.shape[0]
        pad = self.batch_invariant and N == 1  # the dense layers see the row repeated, attention the real one
        # repeated to 2 rows, or in bf16 to the MIN_ROWS a packed linear pads to anyway (the same rows it would build)
        copies = packed.MIN_ROWS if pad and self.embed_tokens.weight.dtype == torch.bfloat16 else 2
        if pad:
            input_ids, positions = input_ids.expand(copies).contiguous(), positions.expand(copies).contiguous()
        x = self.embed(input_ids)  # (N, H), (copies, H) when padded
        rope = Rope(positions)  # cos/sin once per forward, shared by the layers
        captured: dict[int, torch.Tensor] = {}
        want = set(capture_layers or ())
        if fused:  # h: the normed input of the next layer, x: the residual stream
            norm = self.layers[0].input_layernorm
            h = cpu_kernels.rms_norm(x, norm.weight, norm.eps)
        for layer_idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            if fused:
                q, k, v = attn.project_qkv_fused(h, rope.for_layer(attn, x.dtype))
            else:
                q, k, v = layer.pre_attention(x, rope.for_layer(attn, x.dtype))  # (N, Hq, D), (N, Hkv, D) x2
            if pad:
                q, k, v = q[:N], k[:N], v[:N]
            if parts is None:  # each request alone
                attn_out = attend_per_request(attn, layer_idx, q, k, v, layout, caches)
            else:
                attn_out = attend_parts(parts, layer_idx, q, k, v, attn.scale, attn.window, attn.softcap)
            attn_out = attn_out.expand(copies, -1).contiguous() if pad else attn_out  # (N, Hq*D); repeat is slower
            if fused:
                following = self.layers[layer_idx + 1].input_layernorm if layer_idx + 1 < len(self.layers) else self.norm
                x, h = layer.post_attention_fused(x, attn_out, following)
            else:
                x = layer.post_attention(x, attn_out)
            if layer_idx in want:
                captured[layer_idx] = x[:N]
        if caches is not None:
            for cache, n in zip(caches, seq_lens):
                cache.length += n
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return (h[:N] if fused else self.norm(x[:N])), features


def attend_per_request(
    attn, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # (N, Hq, D), (N, Hkv, D) x2
    layout: BatchLayout, caches: list[KVCache] | None,
) -> torch.Tensor:  # (N, Hq*D)
    """The reference path (``Decoder.attention = "per-request"``): a Python loop over requests, each attending
    over its own cache slot. Kept for benchmarks against the batched path and for caches of different pools."""
    outs, offset = [], 0
    for r, n in enumerate(layout.seq_lens):
        q_r = q[offset : offset + n].transpose(0, 1)  # (Hq, n, D)
        k_r = k[offset : offset + n].transpose(0, 1)  # (Hkv, n, D)
        v_r = v[offset : offset + n].transpose(0, 1)
        if caches is not None:
            cache = caches[r]
            s = cache.length
            cache.keys[layer_idx, :, s : s + n] = k_r
            cache.values[layer_idx, :, s : s + n] = v_r
            k_r = cache.keys[layer_idx, :, : s + n]
            v_r = cache.values[layer_idx, :, : s + n]
        mask = causal_mask(layout.positions[offset : offset + n], k_r.shape[1], attn.window)
        outs.append(attn.attend(q_r, k_r, v_r, mask))
        offset += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class CausalLM(nn.Module):
    """Decoder + LM head; parameter names match HF ``*ForCausalLM`` checkpoints."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Decoder(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, V)
        if self.model.batch_invariant and hidden.shape[0] == 1:
            out = self.lm_head(hidden.expand(2, -1).contiguous())[:1]
        else:
            out = self.lm_head(hidden)
        if self.spec.final_softcap:
            out = torch.tanh(out / self.spec.final_softcap) * self.spec.final_softcap
        return out

    def new_cache(self, capacity: int = 256, max_length: int | None = None) -> KVCache:
        """An empty cache with the model's dtype, on the model's device: a slot of the model's ``KVPool``, so
        that all its requests are attended in one call per layer."""
        pool = self._pool(1, capacity, max_length)
        return pool.allocate(min(capacity, max_length) if max_length is not None else capacity, max_length)

    def reserve_kv(self, slots: int, capacity: int, max_length: int | None = None) -> KVPool:
        """Size the pool ``new_cache`` allocates from for ``slots`` requests of ``capacity`` positions now
        (``KVPool.reserve``); it still grows beyond on demand."""
        pool = self._pool(slots, capacity, max_length)
        pool.reserve(slots, capacity)
        return pool

    def _pool(self, slots: int, capacity: int, max_length: int | None) -> KVPool:
        """The model's pool, made with these sizes when there is none for its dtype and device yet."""
        s, weight = self.spec, self.lm_head.weight
        pool = self.__dict__.get("_kv_pool")
        if pool is None or pool.keys.dtype != weight.dtype or pool.keys.device != weight.device:
            capacity = min(capacity, max_length) if max_length is not None else capacity
            pool = KVPool(s.num_layers, s.num_kv_heads, s.head_dim, slots, capacity, weight.dtype, max_length,
                          weight.device)
            self.__dict__["_kv_pool"] = pool  # a plain attribute: not a buffer, never in the state dict
        return pool

    @property
    def kv_pool(self) -> KVPool | None:
        """The pool ``new_cache`` allocates from (None before the first cache)."""
        return self.__dict__.get("_kv_pool")
