"""The DSpark draft model (DFlash = DSpark without heads): parallel backbone, sequential head, confidence head.

Layout and names follow DeepSpec's ``Qwen3DSparkModel`` (docs/interop.md §Drafter checkpoints), so its
checkpoints load and ours load there: ``embed_tokens``, ``layers.{i}.*``, ``norm``,
``fc``, ``hidden_norm``, ``lm_head``, ``markov_head.{markov_w1,markov_w2,joint_proj}``,
``confidence_head.proj`` (no ``model.`` prefix).

Shapes: L = sequence length, n = context positions, A = blocks, G = block size
(gamma), Q = query tokens, N = rows, H = hidden size, F = len(target_layer_ids) * H,
V = target vocabulary, W = draft vocabulary (W = V without one), r = Markov rank,
Hq / Hkv / D = query heads / KV heads / head dim, S = context keys.

Backbone, eqs. (2)-(3) (docs/conventions.md §Context features, docs/interop.md §Drafter checkpoints):
- context = hidden_norm(fc(concat target features)), the same tensor for every layer;
- per layer, queries come from the block tokens only; keys/values are k_proj/v_proj
  over [context; input_layernorm(block)], k_norm (if any) on all keys, RoPE at
  context positions 0.. and block slot k at anchor + k;
- block tokens = [anchor, mask x (G-1)]; a block sees context j < anchor and its own
  slots bidirectionally; final norm; base logits U_k = lm_head(h_k).
Sequential head, eq. (4): p_k = softmax(U_k + B_k), with the Markov bias eq. (5)
B_k = W2 W1[x_{k-1}] or the RNN bias eq. (6). Confidence head eq. (7):
logit_k = proj([h_k; W1[x_{k-1}]]). x_{-1} is the anchor token.

Draft vocabulary (docs/training.md §Draft vocabulary): with ``draft_vocab`` (W target token ids, most
frequent first) the LM head and the Markov head's W1 and W2 hold those W rows only, and every logit the
model returns is over them (index w = token ``draft_vocab[w]``); ``draft_index`` maps token ids to
w (-1 outside). A previous token outside the draft vocabulary (only the anchor can be) gets a zero
Markov embedding W1[x_{-1}] = 0. Without one, W = V and w = token id.

The settings are ``config.py``'s, the heads ``heads.py``'s. ``forward`` returns the
teacher-forced outputs of a sequence's blocks; ``loss.py`` turns them into eq. (12).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from dspark.drafters.checkpoint import (
    FROZEN_PREFIXES,
    arch_name,
    checkpoint_keys,
    check_draft_vocab,
    check_fingerprint,
    check_layer_ids,
    check_target_fit,
    copy_frozen_embeddings,
    draft_spec_from,
    finish_new_drafter,
    load_drafter_weights,
    qwen3_base_config,
    read_draft_vocab,
    target_base_config,
    target_fingerprint,
    vocab_index,
    write_checkpoint,
)
from dspark.drafters.dspark.blocks import Blocks, block_attention_mask, build_blocks, sample_anchors
from dspark.drafters.dspark.config import DRAFT_KEYS, DSparkConfig, config_from_checkpoint, resolve_mask_token_id
from dspark.drafters.dspark.heads import ConfidenceHead, MarkovHead
from dspark.drafters.sample import TrainSample
from dspark.errors import IncompatibleModelsError, ModelLoadError
from dspark.modeling import cpu_kernels
from dspark.modeling.attention import BatchLayout, batched_attention
from dspark.modeling.layers import DecoderLayer, RMSNorm, Rope, RopeInput, fuse_draft_projections
from dspark.modeling.spec import DecoderSpec, spec_from_config
from dspark.modeling.weights import read_config


# --------------------------------------------------------------------------- model


@dataclass
class AttentionGroup:
    """Queries of one sequence (all its blocks) and the context keys they may see."""

    num_queries: int
    context_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> k, v (Hkv, S, D) each
    mask: torch.Tensor | None  # (num_queries, S + num_queries) bool, None = see everything


@dataclass
class DSparkOutputs:
    """The model's outputs on one sequence; only ``anchors`` (empty) when it has no anchor candidate."""

    anchors: torch.Tensor  # (A,) int64
    blocks: Blocks | None = None
    hidden: torch.Tensor | None = None  # (A, G, H) final-normed
    latents: torch.Tensor | None = None  # (A, G, r) teacher-forced Markov latents
    confidence_logits: torch.Tensor | None = None  # (A, G)


class DSparkModel(nn.Module):
    def __init__(self, config: DSparkConfig, spec: DecoderSpec, base_config: dict[str, Any],
                 num_target_layers: int, draft_vocab: torch.Tensor | list[int] | None = None) -> None:
        super().__init__()
        if config.target_layer_ids is None or config.mask_token_id is None:
            raise ValueError("DSparkModel needs resolved target_layer_ids and mask_token_id; use from_target")
        self.config = config
        self.spec = spec
        self.base_config = base_config
        self.num_target_layers = num_target_layers
        H, V = spec.hidden_size, spec.vocab_size
        eps, off = spec.rms_norm_eps, spec.norm_offset
        # the soft-cap of the target's logits (p_t), the draft's own when its layers are the target's family
        self.target_softcap = base_config.get("target_final_logit_softcapping", spec.final_softcap)
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(H, eps, off)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps, off)
        # draft_vocab (W,) int64 target ids, a saved buffer; vocab_index (V,) int64 token id -> w, -1 outside
        if draft_vocab is not None:
            ids = check_draft_vocab(draft_vocab, V)
            self.register_buffer("draft_vocab", ids)
            self.register_buffer("vocab_index", vocab_index(ids, V), persistent=False)
        else:
            self.draft_vocab = self.vocab_index = None
        W = V if draft_vocab is None else self.draft_vocab.numel()
        self.lm_head = nn.Linear(H, W, bias=False)  # the target's LM-head rows over the draft vocabulary
        r = config.markov_rank
        self.markov_head = MarkovHead(W, r, H, config.markov_head_type) if r > 0 else None
        self.target_fingerprint: list[float] | None = None  # target_fingerprint() of the target it was made for
        self.cpu_kernels = False  # decoding rows through dspark.modeling.cpu_kernels (use_cpu_kernels)
        self.attention_kernel = False  # and the blocks' attention through cpu_kernels.attention (use_cpu_kernels)
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + (r if config.confidence_head_with_markov else 0))

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_target(cls, target, cfg: DSparkConfig, generator: torch.Generator | None = None,
                    draft_vocab: list[int] | torch.Tensor | None = None) -> "DSparkModel":
        """A fresh drafter for ``target``: random backbone/heads, embed_tokens and lm_head copied and frozen
        (the LM head's rows over ``draft_vocab`` only, when given)."""
        layer_ids = cfg.target_layer_ids if cfg.target_layer_ids is not None else target.default_layer_ids()
        check_layer_ids(layer_ids, target.num_layers)
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else resolve_mask_token_id(target)
        if not 0 <= mask_id < target.vocab_size:
            raise ValueError(f"mask_token_id {mask_id} is outside the target vocabulary of {target.vocab_size}")
        cfg = dataclasses.replace(cfg, target_layer_ids=list(layer_ids), mask_token_id=int(mask_id))
        base = target_base_config(target)
        spec = draft_spec_from(target.spec, cfg.num_draft_layers, cfg.draft_layer)
        if spec.model_type != target.spec.model_type:  # Qwen3-shaped layers for another family
            base = qwen3_base_config(base, spec, target.spec)
        model = cls(cfg, spec, base, target.num_layers, draft_vocab)
        model.target_fingerprint = target_fingerprint(target)
        return finish_new_drafter(model, target, base, generator)

    def copy_frozen_from(self, target) -> None:
        copy_frozen_embeddings(self, target)

    @classmethod
    def from_checkpoint(cls, folder: Path, target=None) -> "DSparkModel":
        """Load a DeepSpec-layout folder (bf16 or fp32) in float32; checks the fit when ``target`` is given."""
        folder = Path(folder)
        cfg_dict = read_config(folder)
        config = config_from_checkpoint(cfg_dict, folder)
        spec = spec_from_config(cfg_dict)  # the copied target config with the draft's num_hidden_layers
        num_target_layers = cfg_dict.get("num_target_layers")
        if target is not None:
            check_target_fit(f"DSpark drafter {folder}", hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                             target_layer_ids=config.target_layer_ids, num_target_layers=num_target_layers,
                             target=target)
            if not config.mask_token_id < target.vocab_size:
                raise IncompatibleModelsError(
                    f"DSpark drafter {folder}: mask_token_id {config.mask_token_id} is outside the target "
                    f"vocabulary of {target.vocab_size}"
                )
        if num_target_layers is None:
            num_target_layers = target.num_layers if target is not None else max(config.target_layer_ids) + 1
        base = {k: v for k, v in cfg_dict.items() if k not in DRAFT_KEYS}
        what = f"DSpark drafter {folder}"
        vocab = read_draft_vocab(folder, cfg_dict, spec.vocab_size)
        model = cls(config, spec, base, int(num_target_layers), vocab)
        model.target_fingerprint = cfg_dict.get("target_fingerprint")
        if target is not None:
            check_fingerprint(what, model.target_fingerprint, target)
        check_head_tensors(what, checkpoint_keys(folder), set(model.state_dict()), config)
        return load_drafter_weights(model, folder, what, target)

    # ----------------------------------------------------------------- pieces

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def draft_size(self) -> int:
        """W: the tokens the drafter can propose."""
        return self.lm_head.out_features

    def draft_index(self, tokens: torch.Tensor) -> torch.Tensor:  # (...,) token ids -> (...,) w, -1 outside
        return tokens if self.vocab_index is None else self.vocab_index[tokens]

    def draft_tokens(self, index: torch.Tensor) -> torch.Tensor:  # (...,) w -> (...,) token ids
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # (...,) -> (..., H)
        x = self.embed_tokens(ids)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def project_context(self, features: torch.Tensor) -> torch.Tensor:  # (n, F) -> (n, H)
        context = self.fc(features.to(self.fc.weight.dtype))
        if self._fused_rows(context):
            return cpu_kernels.rms_norm(context, self.hidden_norm.weight, self.hidden_norm.eps)
        return self.hidden_norm(context)

    def context_kv(self, layer_idx: int, context: torch.Tensor, positions: RopeInput
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # (n, H), (n,) or its (cos, sin) -> k, v (Hkv, n, D)
        k, v = self.layers[layer_idx].self_attn.project_kv(context, positions)
        return k.transpose(0, 1), v.transpose(0, 1)

    def backbone(
        self,
        x: torch.Tensor,  # (Q, H) embedded block tokens, groups concatenated
        positions: torch.Tensor,  # (Q,) RoPE positions
        groups: list[AttentionGroup],
        layout: BatchLayout | None = None,  # decoding: the context caches' pool; one attention call per layer
    ) -> torch.Tensor:  # (Q, H) final-normed hidden states h_k
        rope = Rope(positions)  # cos/sin once per forward, shared by the layers
        fused = self._fused_rows(x)
        if fused:  # h: the normed input of the next layer, x: the residual stream
            norm = self.layers[0].input_layernorm
            h = cpu_kernels.rms_norm(x, norm.weight, norm.eps)
        for layer_idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            if not fused:
                h = layer.input_layernorm(x)
            cos_sin = rope.for_layer(attn, h.dtype)
            q, k, v = attn.project_qkv(h, cos_sin)  # (Q, Hq, D), (Q, Hkv, D) x2
            if layout is not None:  # the blocks' keys go after each context in its slot (beyond its length)
                keys, values = layout.store_and_read(layer_idx, k, v)  # (R, Hkv, S, D) x2
                if fused and self.attention_kernel and layout.pool is not None:  # every request in one C call
                    lo, hi, offsets, work = layout.kernel_ranges(attn.window)  # a block reads its context and itself
                    attn_out = cpu_kernels.attention(q.contiguous(), keys, values, layout.slots, offsets, lo, hi,
                                                     attn.scale, work)
                else:
                    attn_out = batched_attention(q, keys, values, layout, attn.scale, attn.window, attn.softcap)
            else:
                outs, offset = [], 0
                for g in groups:
                    sl = slice(offset, offset + g.num_queries)
                    ck, cv = g.context_kv(layer_idx)  # (Hkv, S, D)
                    keys = torch.cat([ck, k[sl].transpose(0, 1)], dim=1)  # (Hkv, S + n, D)
                    values = torch.cat([cv, v[sl].transpose(0, 1)], dim=1)
                    outs.append(attn.attend(q[sl].transpose(0, 1), keys, values, g.mask))
                    offset += g.num_queries
                attn_out = torch.cat(outs) if len(outs) > 1 else outs[0]
            if fused:  # each residual add and the norm after it in one pass
                following = self.layers[layer_idx + 1].input_layernorm if layer_idx + 1 < len(self.layers) else self.norm
                x, h = layer.post_attention_fused(x, attn_out, following)
            else:
                x = layer.attn_residual(x, attn_out)
                x = layer.mlp_residual(x)
        return h if fused else self.norm(x)

    def use_cpu_kernels(self, on: bool = True) -> bool:
        """Decoding on the CPU: the fused layout (``fuse_draft_projections``) and, where this drafter's layers can
        take them (plain RMSNorms, SiLU, no sandwich norms) and they are built here, the fused CPU kernels
        (``dspark.modeling.cpu_kernels``) for the backbone's norms and residual adds, and its attention kernel for
        every block of the batch in one call (``DSPARK_ATTENTION_KERNEL=0`` leaves it to torch's fused attention).
        Returns whether the kernels are on.
        The projections are then fused ones, so the model is for decoding only (not saved or trained)."""
        fuse_draft_projections(self.layers)
        self.cpu_kernels = bool(on and cpu_kernels.layers_fit(self.spec) and cpu_kernels.available())
        self.attention_kernel = self.cpu_kernels and cpu_kernels.attention_fits(self.layers[0].self_attn)
        return self.cpu_kernels

    @property
    def decoding_layout(self) -> bool:
        """Whether the projections are fused for decoding (``use_cpu_kernels``): then not for saving or training."""
        return self.layers[0].self_attn.qkv_proj is not None

    def _fused_rows(self, x: torch.Tensor) -> bool:  # (Q, H): bf16 decoding rows on the CPU, no gradients
        return (self.cpu_kernels and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not torch.is_grad_enabled())

    def base_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """U_k: (..., H) -> (..., W); with ``rows`` (M, H), some rows of the LM head, -> (..., M) for those only."""
        out = self.lm_head(hidden) if rows is None else F.linear(hidden, rows)
        if self.spec.final_softcap:
            out = torch.tanh(out / self.spec.final_softcap) * self.spec.final_softcap
        return out

    def draft_logits(self, hidden: torch.Tensor, latent: torch.Tensor | None) -> torch.Tensor:
        """U_k + B_k, eq. (4): (..., H), (..., r) -> (..., W)."""
        logits = self.base_logits(hidden)
        if latent is not None:
            logits = logits + self.markov_head.bias(latent).to(logits.dtype)
        return logits

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Raw confidence logits, eq. (7): (..., H), (...,) token ids x_{k-1} -> (...,)."""
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.config.confidence_head_with_markov:
            e = self.markov_head.prev_embed(self.draft_index(prev)).to(hidden.dtype)  # (..., r)
            feats = torch.cat([hidden, e], dim=-1)
        return self.confidence_head(feats).float()

    def head_step(
        self,
        state: torch.Tensor | None,  # (N, r) RNN state or None
        hidden: torch.Tensor,  # (N, H) h_k
        prev: torch.Tensor,  # (N,) x_{k-1}, token ids
        base: torch.Tensor | None = None,  # (N, W) U_k when the caller computed it already
        candidates: torch.Tensor | None = None,  # (N, M) draft indices w: add B_k there only, -inf elsewhere
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:  # state, logits (N, W), confidence (N,)
        """One left-to-right step of the sequential head (inference), eq. (4).

        With ``candidates`` the step drafts from the M tokens given (in practice the top M of U_k): their
        logits are U_k + B_k exactly, every other token gets -inf. That is a different draft distribution,
        not an approximation the verifier has to know about: the returned logits are what is sampled from
        and reported, so rejection sampling stays lossless. It skips the V x r product of the head.
        """
        if base is None:
            base = self.base_logits(hidden)
        if self.markov_head is None:  # no sequential head: U_k over every token
            candidates = None
        state, scores = self.head_scores(state, hidden, prev, base, candidates)
        logits = scores if candidates is None else torch.full_like(base, float("-inf")).scatter_(-1, candidates, scores)
        return state, logits, self.confidence_logits(hidden, prev)

    def head_scores(
        self,
        state: torch.Tensor | None,  # (N, r) RNN state or None
        hidden: torch.Tensor,  # (N, H) h_k
        prev: torch.Tensor,  # (N,) x_{k-1}, token ids
        base: torch.Tensor,  # (N, W) U_k
        candidates: torch.Tensor | None = None,  # (N, M) draft indices w
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # state, U_k + B_k: (N, W), or (N, M) at the candidates only
        """``head_step``'s logits before they are spread over the draft vocabulary: with ``candidates`` only the M
        scores the step drafts from (a greedy draft is the best of them, and needs nothing W wide), no confidence.
        """
        latent = None
        if self.markov_head is not None:
            state, latent = self.markov_head.step(state, hidden, self.draft_index(prev))
        if candidates is None:
            return state, base if latent is None else base + self.markov_head.bias(latent).to(base.dtype)
        picked = base.gather(-1, candidates)  # (N, M)
        if latent is not None:
            picked = picked + self.markov_head.bias_at(latent, candidates).to(base.dtype)
        return state, picked

    # ----------------------------------------------------------------- training

    def forward(self, sample: TrainSample, generator: torch.Generator | None = None) -> DSparkOutputs:
        """Teacher-forced outputs of up to ``num_anchors`` blocks drawn with ``generator`` (the loss is
        ``DSparkLoss``'s job)."""
        anchors = sample_anchors(sample.loss_mask, self.config.num_anchors, generator)
        if anchors.numel() == 0:
            return DSparkOutputs(anchors)
        return self.block_outputs(sample, anchors)

    def block_outputs(self, sample: TrainSample, anchors: torch.Tensor) -> DSparkOutputs:
        """All blocks of one sequence in one packed attention call (teacher-forced heads)."""
        cfg, G = self.config, self.config.block_size
        blocks = build_blocks(sample.input_ids, sample.loss_mask, anchors, G, cfg.mask_token_id, cfg.slot_offset)
        A = blocks.num_blocks
        ctx_len = int(anchors.max()) if A else 0  # no block sees context at or after its anchor
        context = self.project_context(sample.target_features[:ctx_len])  # (ctx_len, H)
        ctx_rope = Rope(torch.arange(ctx_len, device=anchors.device))
        group = AttentionGroup(
            A * G, lambda i: self.context_kv(i, context, ctx_rope.for_layer(self.layers[i].self_attn, context.dtype)),
            block_attention_mask(anchors, ctx_len, G),
        )
        x = self.embed(blocks.block_ids.flatten())  # (Q, H)
        hidden = self.backbone(x, blocks.positions.flatten(), [group]).view(A, G, -1)
        prev = self.draft_index(blocks.prev_tokens)  # (A, G) w of x_{k-1}, -1 outside the draft vocabulary
        latents, s = None, cfg.slot_offset
        if self.markov_head is not None:  # the head starts at the first drafting slot (an RNN's s_0 = 0 there)
            latents = self.markov_head.latents(hidden[:, s:], prev[:, s:])
            if s:  # slot 0 of an anchor + k block drafts nothing: a zero latent keeps the (A, G, r) layout
                latents = torch.cat([latents.new_zeros(A, s, latents.shape[-1]), latents], dim=1)
        conf = self.confidence_logits(hidden, blocks.prev_tokens)
        return DSparkOutputs(anchors, blocks, hidden, latents, conf)

    def block_logits(self, sample: TrainSample, anchors: torch.Tensor) -> torch.Tensor:  # (A, G, W)
        """Teacher-forced Markov-corrected logits of every slot (tests, analysis; materialises A*G*W)."""
        out = self.block_outputs(sample, anchors)
        return self.draft_logits(out.hidden, out.latents)

    def target_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:  # (m, H) -> (m, W)
        """The target's logits from its final-normed hidden state, through the shared (frozen) LM head
        (over the draft vocabulary: normalise with the target's full-vocabulary log-sum-exp, see loss.py)."""
        out = self.lm_head(target_hidden.to(self.lm_head.weight.dtype))
        if self.target_softcap:
            out = torch.tanh(out / self.target_softcap) * self.target_softcap
        return out

    def grow(self, num_layers: int) -> None:
        """Append draft layers up to ``num_layers`` that leave the drafter's outputs as they are (a warm start to a
        deeper drafter): each new layer is a copy of the last one with its output projections (``o_proj``,
        ``down_proj``) zeroed, so both residual branches add nothing until training moves them."""
        old = len(self.layers)
        if num_layers < old:
            raise ValueError(f"cannot grow a {old}-layer drafter to {num_layers} layers")
        if self.decoding_layout:
            raise RuntimeError("grow the model as trained, not one loaded for decoding")
        types = list(self.spec.layer_types)
        if types:
            types += [types[-1]] * (num_layers - old)
        self.spec = dataclasses.replace(self.spec, num_layers=num_layers, layer_types=types)
        last = self.layers[-1]
        for i in range(old, num_layers):
            layer = DecoderLayer(self.spec, i).to(device=last.input_layernorm.weight.device,
                                                  dtype=last.input_layernorm.weight.dtype)
            layer.load_state_dict(last.state_dict())
            with torch.no_grad():
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    if proj.bias is not None:
                        proj.bias.zero_()
            self.layers.append(layer)
        self.config = dataclasses.replace(self.config, num_draft_layers=num_layers)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Everything except the frozen embed_tokens and lm_head."""
        frozen = {id(self.embed_tokens.weight), id(self.lm_head.weight)}
        return [p for p in self.parameters() if id(p) not in frozen]

    # ----------------------------------------------------------------- checkpoint

    def hf_config(self) -> dict[str, Any]:
        """config.json in DeepSpec's layout: the target config plus top-level draft keys (docs/interop.md §Drafter checkpoints)."""
        cfg = self.config
        n = self.spec.num_layers
        out = copy.deepcopy(self.base_config)
        # DeepSpec's name for its convention; an anchor + k drafter is named as z-lab's and vLLM's DFlash is
        arch = "DFlashDraftModel" if cfg.slot_offset else arch_name(self.spec.model_type, "DSparkModel")
        out.update({
            "architectures": [arch],
            "slot_offset": cfg.slot_offset,
            "num_hidden_layers": n,
            "layer_types": ["full_attention"] * n,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "num_anchors": cfg.num_anchors,
            "enable_confidence_head": cfg.enable_confidence_head,
            "markov_rank": cfg.markov_rank,
            "draft_layer": cfg.draft_layer,
            "target_fingerprint": self.target_fingerprint,
            # training settings (not in DeepSpec's config.json; harmless extra keys, used to resume)
            "loss_decay_gamma": cfg.loss_decay_gamma,
            "ce_loss_alpha": cfg.ce_loss_alpha,
            "l1_loss_alpha": cfg.l1_loss_alpha,
            "confidence_head_alpha": cfg.confidence_head_alpha,
        })
        for key in ("confidence_head_with_markov", "markov_head_type"):
            out.pop(key, None)
        if cfg.enable_confidence_head:
            out["confidence_head_with_markov"] = cfg.confidence_head_with_markov
        if cfg.markov_rank > 0:
            out["markov_head_type"] = cfg.markov_head_type
        out.pop("draft_vocab_size", None)
        if self.draft_vocab is not None:
            out["draft_vocab_size"] = self.draft_size
        return out

    def save_checkpoint(self, folder: Path, dtype: torch.dtype = torch.float32) -> None:
        """Write model.safetensors + config.json into ``folder`` (DeepSpec saves bf16; pass dtype=torch.bfloat16).

        With a draft vocabulary the frozen embed_tokens and lm_head are left out (the loader copies them
        from the target) and ``draft_vocab`` (W,) int64 is stored: a DSpark-only checkpoint. Without one
        every tensor is written, DeepSpec's layout."""
        if self.decoding_layout:
            raise RuntimeError("this drafter was loaded for decoding (fused projections, prepacked weights); save "
                               "the model it was loaded from, or load it with load_dspark_drafter(..., pack=False)")
        state = self.state_dict()
        if self.draft_vocab is not None:
            state = {k: v for k, v in state.items() if not k.startswith(FROZEN_PREFIXES)}
        write_checkpoint(Path(folder), state, self.hf_config(), dtype)


def check_head_tensors(what: str, saved: set[str], expected: set[str], config: DSparkConfig) -> None:
    """ModelLoadError when the checkpoint's head tensors are not those its config.json's head settings build:
    a gated or RNN head read as vanilla, or a confidence head that would be dropped, must not load silently."""
    heads = ("markov_head.", "confidence_head.")
    extra = sorted(k for k in saved if k.startswith(heads) and k not in expected)
    if extra:
        raise ModelLoadError(
            f"{what}: the checkpoint holds {extra[:3]} but config.json (markov_rank {config.markov_rank}, "
            f"markov_head_type {config.markov_head_type!r}, enable_confidence_head {config.enable_confidence_head}) "
            "builds no such tensor; the config and weights disagree")
