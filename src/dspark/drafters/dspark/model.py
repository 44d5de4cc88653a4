"""The DSpark draft model (DFlash = DSpark without heads): parallel backbone, sequential head, confidence head.

Layout and names follow DeepSpec's ``Qwen3DSparkModel`` (interop-facts §1), so its
checkpoints load and ours load there: ``embed_tokens``, ``layers.{i}.*``, ``norm``,
``fc``, ``hidden_norm``, ``lm_head``, ``markov_head.{markov_w1,markov_w2,joint_proj}``,
``confidence_head.proj`` (no ``model.`` prefix).

Shapes: L = sequence length, n = context positions, A = blocks, G = block size
(gamma), Q = query tokens, N = rows, H = hidden size, F = len(target_layer_ids) * H,
V = vocabulary, r = Markov rank, Hq / Hkv / D = query heads / KV heads / head dim,
S = context keys.

Backbone (DESIGN.md §2, interop-facts §1):
- context = hidden_norm(fc(concat target features)), the same tensor for every layer;
- per layer, queries come from the block tokens only; keys/values are k_proj/v_proj
  over [context; input_layernorm(block)], k_norm (if any) on all keys, RoPE at
  context positions 0.. and block slot k at anchor + k;
- block tokens = [anchor, mask x (G-1)]; a block sees context j < anchor and its own
  slots bidirectionally; final norm; base logits U_k = lm_head(h_k).
Sequential head, eq. (4): p_k = softmax(U_k + B_k), with the Markov bias eq. (5)
B_k = W2 W1[x_{k-1}] or the RNN bias eq. (6). Confidence head eq. (7):
logit_k = proj([h_k; W1[x_{k-1}]]). x_{-1} is the anchor token.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from dspark.drafters.checkpoint import (
    copy_frozen_embeddings,
    load_drafter_weights,
    arch_name,
    check_layer_ids,
    check_target_fit,
    draft_spec_from,
    init_weights,
    target_base_config,
    write_checkpoint,
)
from dspark.errors import IncompatibleModelsError, ModelLoadError
from dspark.modeling.layers import DecoderLayer, RMSNorm
from dspark.modeling.spec import DecoderSpec, spec_from_config
from dspark.modeling.weights import read_config
from dspark.drafters.dspark.blocks import Blocks, block_attention_mask, build_blocks, sample_anchors
from dspark.drafters.losses import (
    chunked_row_terms,
    confidence_bce,
    position_weights,
    tau_estimate,
    weighted_mean,
)
from dspark.drafters.sample import TrainSample

MARKOV_HEAD_TYPES = ("vanilla", "rnn")


# --------------------------------------------------------------------------- config


@dataclass
class DSparkConfig:
    """DSpark drafter and training settings (DeepSpec names). ``DSparkConfig.dflash()`` gives DFlash."""

    block_size: int = 7
    num_draft_layers: int = 1
    target_layer_ids: list[int] | None = None  # None: target.default_layer_ids()
    # None: the first embedding row past the tokenizer if the vocabulary has spare rows (DeepSpec's
    # choice for Qwen3), else the tokenizer's unk token, else its pad token unless that is a stop
    # token, else vocab_size - 1. See resolve_mask_token_id.
    mask_token_id: int | None = None
    num_anchors: int = 64  # DeepSpec uses 512 on GPUs; 64 keeps CPU memory modest
    markov_rank: int = 256  # 0 = no sequential head (DFlash)
    markov_head_type: str = "vanilla"  # "vanilla" eq. (5) | "rnn" eq. (6)
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    loss_decay_gamma: float = 4.0
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    confidence_head_alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = no sequential head), got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "confidence_head_with_markov needs a Markov head (markov_rank > 0); "
                "set confidence_head_with_markov=False or enable_confidence_head=False"
            )
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
            check_layer_ids(self.target_layer_ids)
        for name in ("ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def dflash(cls, **overrides: Any) -> "DSparkConfig":
        """DFlash: the same backbone, no sequential head, no confidence head, CE only (interop-facts §1)."""
        base = dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False,
                    ce_loss_alpha=1.0, l1_loss_alpha=0.0, confidence_head_alpha=0.0)
        return cls.from_dict({**base, **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DSparkConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown DSpark config keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_dflash(self) -> bool:
        return self.markov_rank == 0 and not self.enable_confidence_head


def resolve_mask_token_id(target) -> int:
    """A token id for the block's mask slots (see ``DSparkConfig.mask_token_id``)."""
    V = target.vocab_size
    tok = target.tokenizer
    if tok is None:
        return V - 1
    if len(tok) < V:  # a spare embedding row nothing ever produces (DeepSpec: 151669 for Qwen3)
        return len(tok)
    stops = set(target.eos_token_ids)
    for cand in (tok.unk_token_id, tok.pad_token_id):
        if cand is not None and 0 <= cand < V and cand not in stops:
            return int(cand)
    return V - 1


# --------------------------------------------------------------------------- heads


class MarkovHead(nn.Module):
    """Sequential head: vanilla Markov bias eq. (5) or gated RNN bias eq. (6)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        self.rank, self.head_type = rank, head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # W1: V x r lookup
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # W2: r -> V
        if head_type == "rnn":
            # W_g, W_c, W_o as one linear over z = [s_{k-1}; W1[x_{k-1}]; h_k], split in three
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor:  # (...,) -> (..., r)
        return self.markov_w1(prev)

    def step(
        self,
        state: torch.Tensor | None,  # (N, r) s_{k-1}; None = s_0 = 0
        hidden: torch.Tensor,  # (N, H) h_k
        prev: torch.Tensor,  # (N,) x_{k-1}
    ) -> tuple[torch.Tensor | None, torch.Tensor]:  # new state (N, r) or None, latent u_k (N, r); B_k = W2 u_k
        e = self.prev_embed(prev).to(hidden.dtype)  # (N, r)
        if self.head_type == "vanilla":
            return None, e  # eq. (5): B_k = W2 W1[x_{k-1}]
        if state is None:
            state = hidden.new_zeros(hidden.shape[0], self.rank)
        z = torch.cat([state, e, hidden], dim=-1)  # (N, 2r + H)
        gate, cand, out = self.joint_proj(z).chunk(3, dim=-1)  # eq. (6)
        gate = torch.sigmoid(gate)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return new_state, torch.tanh(out)

    def latents(
        self,
        hidden: torch.Tensor,  # (A, G, H)
        prev: torch.Tensor,  # (A, G) teacher-forced previous tokens
    ) -> torch.Tensor:  # (A, G, r)
        if self.head_type == "vanilla":
            return self.prev_embed(prev).to(hidden.dtype)
        state, out = None, []
        for k in range(hidden.shape[1]):
            state, u = self.step(state, hidden[:, k], prev[:, k])
            out.append(u)
        return torch.stack(out, dim=1)

    def bias(self, latent: torch.Tensor) -> torch.Tensor:  # (..., r) -> (..., V)
        return self.markov_w2(latent)

    def bias_at(self, latent: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """B_k at some tokens only: (N, r), (N, M) token ids -> (N, M). Reads M rows of W2 instead of all V."""
        rows = self.markov_w2.weight[candidates]  # (N, M, r)
        return (rows @ latent.to(rows.dtype)[:, :, None])[..., 0]  # (N, M)


class ConfidenceHead(nn.Module):
    """DeepSpec's ``AcceptRatePredictor``: one linear unit, eq. (7)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (...,)
        return self.proj(x).squeeze(-1)


# --------------------------------------------------------------------------- model


@dataclass
class AttentionGroup:
    """Queries of one sequence (all its blocks) and the context keys they may see."""

    num_queries: int
    context_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> k, v (Hkv, S, D) each
    mask: torch.Tensor | None  # (num_queries, S + num_queries) bool, None = see everything


@dataclass
class BlockOutputs:
    blocks: Blocks
    hidden: torch.Tensor  # (A, G, H) final-normed
    latents: torch.Tensor | None  # (A, G, r) teacher-forced Markov latents
    confidence_logits: torch.Tensor | None  # (A, G)


class DSparkModel(nn.Module):
    def __init__(self, config: DSparkConfig, spec: DecoderSpec, base_config: dict[str, Any],
                 num_target_layers: int) -> None:
        super().__init__()
        if config.target_layer_ids is None or config.mask_token_id is None:
            raise ValueError("DSparkModel needs resolved target_layer_ids and mask_token_id; use from_target")
        self.config = config
        self.spec = spec
        self.base_config = base_config
        self.num_target_layers = num_target_layers
        H, V = spec.hidden_size, spec.vocab_size
        eps, off = spec.rms_norm_eps, spec.norm_offset
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(H, eps, off)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps, off)
        self.lm_head = nn.Linear(H, V, bias=False)
        r = config.markov_rank
        self.markov_head = MarkovHead(V, r, H, config.markov_head_type) if r > 0 else None
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + (r if config.confidence_head_with_markov else 0))

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_target(cls, target, cfg: DSparkConfig, generator: torch.Generator | None = None) -> "DSparkModel":
        """A fresh drafter for ``target``: random backbone/heads, embed_tokens and lm_head copied and frozen."""
        layer_ids = cfg.target_layer_ids if cfg.target_layer_ids is not None else target.default_layer_ids()
        check_layer_ids(layer_ids, target.num_layers)
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else resolve_mask_token_id(target)
        if not 0 <= mask_id < target.vocab_size:
            raise ValueError(f"mask_token_id {mask_id} is outside the target vocabulary of {target.vocab_size}")
        cfg = dataclasses.replace(cfg, target_layer_ids=list(layer_ids), mask_token_id=int(mask_id))
        base = target_base_config(target)
        model = cls(cfg, draft_spec_from(target.spec, cfg.num_draft_layers), base, target.num_layers)
        init_weights(model, float(base.get("initializer_range", 0.02)), generator)
        model.copy_frozen_from(target)
        return model.to(target.dtype)

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
        base = {k: v for k, v in cfg_dict.items() if k not in _DRAFT_KEYS}
        model = cls(config, spec, base, int(num_target_layers))
        return load_drafter_weights(model, folder, f"DSpark drafter {folder}", target)

    # ----------------------------------------------------------------- pieces

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # (...,) -> (..., H)
        x = self.embed_tokens(ids)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def project_context(self, features: torch.Tensor) -> torch.Tensor:  # (n, F) -> (n, H)
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, layer_idx: int, context: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # (n, H), (n,) -> k, v (Hkv, n, D)
        k, v = self.layers[layer_idx].self_attn.project_kv(context, positions)
        return k.transpose(0, 1), v.transpose(0, 1)

    def backbone(
        self,
        x: torch.Tensor,  # (Q, H) embedded block tokens, groups concatenated
        positions: torch.Tensor,  # (Q,) RoPE positions
        groups: list[AttentionGroup],
    ) -> torch.Tensor:  # (Q, H) final-normed hidden states h_k
        for layer_idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.project_q(h, positions)  # (Q, Hq, D)
            k, v = attn.project_kv(h, positions)  # (Q, Hkv, D)
            outs, offset = [], 0
            for g in groups:
                sl = slice(offset, offset + g.num_queries)
                ck, cv = g.context_kv(layer_idx)  # (Hkv, S, D)
                keys = torch.cat([ck, k[sl].transpose(0, 1)], dim=1)  # (Hkv, S + n, D)
                values = torch.cat([cv, v[sl].transpose(0, 1)], dim=1)
                outs.append(attn.attend(q[sl].transpose(0, 1), keys, values, g.mask))
                offset += g.num_queries
            x = layer.attn_residual(x, torch.cat(outs) if len(outs) > 1 else outs[0])
            x = layer.mlp_residual(x)
        return self.norm(x)

    def base_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """U_k: (..., H) -> (..., V); with ``rows`` (S, H), some rows of the LM head, -> (..., S) for those only."""
        out = self.lm_head(hidden) if rows is None else F.linear(hidden, rows)
        if self.spec.final_softcap:
            out = torch.tanh(out / self.spec.final_softcap) * self.spec.final_softcap
        return out

    def draft_logits(self, hidden: torch.Tensor, latent: torch.Tensor | None) -> torch.Tensor:
        """U_k + B_k, eq. (4): (..., H), (..., r) -> (..., V)."""
        logits = self.base_logits(hidden)
        if latent is not None:
            logits = logits + self.markov_head.bias(latent).to(logits.dtype)
        return logits

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Raw confidence logits, eq. (7): (..., H), (...,) -> (...,)."""
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.config.confidence_head_with_markov:
            feats = torch.cat([hidden, self.markov_head.prev_embed(prev).to(hidden.dtype)], dim=-1)
        return self.confidence_head(feats).float()

    def head_step(
        self,
        state: torch.Tensor | None,  # (N, r) RNN state or None
        hidden: torch.Tensor,  # (N, H) h_k
        prev: torch.Tensor,  # (N,) x_{k-1}
        base: torch.Tensor | None = None,  # (N, V) U_k when the caller computed it already
        candidates: torch.Tensor | None = None,  # (N, M) token ids: add B_k there only, -inf elsewhere
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:  # state, logits (N, V), confidence (N,)
        """One left-to-right step of the sequential head (inference), eq. (4).

        With ``candidates`` the step drafts from the M tokens given (in practice the top M of U_k): their
        logits are U_k + B_k exactly, every other token gets -inf. That is a different draft distribution,
        not an approximation the verifier has to know about: the returned logits are what is sampled from
        and reported, so rejection sampling stays lossless. It skips the V x r product of the head.
        """
        latent = None
        if self.markov_head is not None:
            state, latent = self.markov_head.step(state, hidden, prev)
        if base is None:
            base = self.base_logits(hidden)
        if latent is None:
            logits = base
        elif candidates is None:
            logits = base + self.markov_head.bias(latent).to(base.dtype)
        else:
            picked = base.gather(-1, candidates) + self.markov_head.bias_at(latent, candidates).to(base.dtype)
            logits = torch.full_like(base, float("-inf")).scatter_(-1, candidates, picked)
        return state, logits, self.confidence_logits(hidden, prev)

    # ----------------------------------------------------------------- training

    def block_outputs(self, sample: TrainSample, anchors: torch.Tensor) -> BlockOutputs:
        """All blocks of one sequence in one packed attention call (teacher-forced heads)."""
        cfg, G = self.config, self.config.block_size
        blocks = build_blocks(sample.input_ids, sample.loss_mask, anchors, G, cfg.mask_token_id)
        A = blocks.num_blocks
        ctx_len = int(anchors.max()) if A else 0  # no block sees context at or after its anchor
        context = self.project_context(sample.target_features[:ctx_len])  # (ctx_len, H)
        ctx_pos = torch.arange(ctx_len, device=anchors.device)
        group = AttentionGroup(
            A * G, lambda layer_idx: self.context_kv(layer_idx, context, ctx_pos),
            block_attention_mask(anchors, ctx_len, G),
        )
        x = self.embed(blocks.block_ids.flatten())  # (Q, H)
        hidden = self.backbone(x, blocks.positions.flatten(), [group]).view(A, G, -1)
        latents = self.markov_head.latents(hidden, blocks.prev_tokens) if self.markov_head is not None else None
        conf = self.confidence_logits(hidden, blocks.prev_tokens)
        return BlockOutputs(blocks, hidden, latents, conf)

    def block_logits(self, sample: TrainSample, anchors: torch.Tensor) -> torch.Tensor:  # (A, G, V)
        """Teacher-forced Markov-corrected logits of every slot (tests, analysis; materialises A*G*V)."""
        out = self.block_outputs(sample, anchors)
        return self.draft_logits(out.hidden, out.latents)

    def _target_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:  # (m, H) -> (m, V)
        return self.base_logits(target_hidden.to(self.lm_head.weight.dtype))

    def _zero_loss(self) -> torch.Tensor:
        """A zero that touches every trainable parameter (keeps DDP's gradient buckets complete)."""
        return sum((p.sum() * 0.0 for p in self.trainable_parameters()), torch.zeros((), device=self.fc.weight.device))

    def training_loss(self, sample: TrainSample, generator: torch.Generator | None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of eq. (12) on one sequence, and metrics (ce, l1, bce, acc@k, tau, ...)."""
        cfg = self.config
        anchors = sample_anchors(sample.loss_mask, cfg.num_anchors, generator)
        metrics: dict[str, float] = {"num_blocks": float(anchors.numel()), "supervised_tokens": 0.0,
                                     "weight_sum": 0.0}
        if anchors.numel() == 0:
            return self._zero_loss(), {**metrics, "loss": 0.0}
        out = self.block_outputs(sample, anchors)
        blocks = out.blocks
        weights = position_weights(blocks.eval_mask, cfg.loss_decay_gamma)  # (A, G)
        rows = blocks.eval_mask.flatten().nonzero().squeeze(-1)  # (M,) supervised (block, slot) pairs
        if rows.numel() == 0:
            return self._zero_loss(), {**metrics, "loss": 0.0}
        H = out.hidden.shape[-1]
        hidden = out.hidden.reshape(-1, H)[rows]  # (M, H)
        latents = out.latents.reshape(-1, out.latents.shape[-1])[rows] if out.latents is not None else None
        target_hidden = sample.target_last_hidden[blocks.target_index.flatten()[rows]]  # (M, H)
        labels = blocks.labels.flatten()[rows]  # (M,)
        w = weights.flatten()[rows]  # (M,)
        ce, l1 = chunked_row_terms(self.draft_logits, self._target_logits, (hidden, latents), target_hidden, labels)
        soft = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)  # eq. (8): c* = sum_v min(p_d, p_t)
        loss_ce = weighted_mean(ce, w)  # eq. (9)
        loss_l1 = weighted_mean(l1, w)  # eq. (10)
        total = cfg.ce_loss_alpha * loss_ce
        if cfg.l1_loss_alpha > 0:
            total = total + cfg.l1_loss_alpha * loss_l1
        metrics.update(ce=float(loss_ce.detach()), l1=float(loss_l1.detach()))
        if out.confidence_logits is not None:
            conf = out.confidence_logits.flatten()[rows]
            loss_bce = weighted_mean(confidence_bce(conf, soft), w)  # eq. (11)
            total = total + cfg.confidence_head_alpha * loss_bce
            metrics["bce"] = float(loss_bce.detach())
            metrics["confidence_abs_error"] = float(weighted_mean((torch.sigmoid(conf.detach()) - soft).abs(), w))
        metrics.update(self._acceptance_metrics(soft, rows, blocks.eval_mask))
        metrics["supervised_tokens"] = float(rows.numel())
        metrics["weight_sum"] = float(w.sum())  # the denominator of every term (for global re-weighting)
        metrics["loss"] = float(total.detach())
        return total, metrics  # eq. (12)

    @staticmethod
    def _acceptance_metrics(soft: torch.Tensor, rows: torch.Tensor, eval_mask: torch.Tensor) -> dict[str, float]:
        """acc@k = mean soft acceptance sum_v min(p_d, p_t) over supervised slots k; tau = 1 + sum prod acc."""
        grid = torch.zeros(eval_mask.numel(), device=soft.device)
        grid[rows] = soft.float()
        grid = grid.view(eval_mask.shape)
        out: dict[str, float] = {}
        counts = eval_mask.sum(0)
        for k in range(eval_mask.shape[1]):
            if int(counts[k]) > 0:
                out[f"acc@{k}"] = float(grid[:, k].sum() / counts[k])
        tau = tau_estimate(grid, eval_mask)
        if not math.isnan(tau):
            out["tau"] = tau
        return out

    def forward(self, sample: TrainSample, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
        """Same as ``training_loss`` (so DDP/FSDP wrappers, which hook ``forward``, work)."""
        return self.training_loss(sample, generator)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Everything except the frozen embed_tokens and lm_head."""
        frozen = {id(self.embed_tokens.weight), id(self.lm_head.weight)}
        return [p for p in self.parameters() if id(p) not in frozen]

    # ----------------------------------------------------------------- checkpoint

    def hf_config(self) -> dict[str, Any]:
        """config.json in DeepSpec's layout: the target config plus top-level draft keys (interop-facts §1)."""
        cfg = self.config
        n = self.spec.num_layers
        out = copy.deepcopy(self.base_config)
        out.update({
            "architectures": [arch_name(self.spec.model_type, "DSparkModel")],
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
        return out

    def save_checkpoint(self, folder: Path, dtype: torch.dtype = torch.float32) -> None:
        """Write model.safetensors + config.json into ``folder`` (DeepSpec saves bf16; pass dtype=torch.bfloat16)."""
        write_checkpoint(Path(folder), self.state_dict(), self.hf_config(), dtype)


# keys of config.json that belong to the draft, not to the copied target config
_DRAFT_KEYS = {
    "architectures", "num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "num_anchors",
    "enable_confidence_head", "markov_rank", "markov_head_type", "confidence_head_with_markov",
    "loss_decay_gamma", "ce_loss_alpha", "l1_loss_alpha", "confidence_head_alpha", "dflash_config",
    "torch_dtype", "dtype",
}


def config_from_checkpoint(cfg: dict[str, Any], folder: Path | str = "") -> DSparkConfig:
    """DSparkConfig from a DeepSpec config.json (top-level keys; SpecForge's ``dflash_config`` also read)."""
    nested = cfg.get("dflash_config") or {}

    def get(key: str, default: Any = None) -> Any:
        return cfg.get(key, nested.get(key, default))

    for key in ("block_size", "target_layer_ids", "mask_token_id"):
        if get(key) is None:
            raise ModelLoadError(f"{folder}/config.json lacks {key!r}: not a DSpark/DFlash checkpoint")
    rank = int(get("markov_rank", 0) or 0)
    conf = bool(get("enable_confidence_head", False))
    defaults = DSparkConfig() if rank > 0 or conf else DSparkConfig.dflash()
    try:
        return DSparkConfig(
            block_size=int(get("block_size")),
            num_draft_layers=int(cfg["num_hidden_layers"]),
            target_layer_ids=[int(i) for i in get("target_layer_ids")],
            mask_token_id=int(get("mask_token_id")),
            num_anchors=int(get("num_anchors", defaults.num_anchors)),
            markov_rank=rank,
            markov_head_type=str(get("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=conf,
            confidence_head_with_markov=bool(get("confidence_head_with_markov", False)) and conf,
            loss_decay_gamma=float(get("loss_decay_gamma", defaults.loss_decay_gamma)),
            ce_loss_alpha=float(get("ce_loss_alpha", defaults.ce_loss_alpha)),
            l1_loss_alpha=float(get("l1_loss_alpha", defaults.l1_loss_alpha)),
            confidence_head_alpha=float(get("confidence_head_alpha", defaults.confidence_head_alpha)),
        )
    except (ValueError, KeyError) as err:
        raise ModelLoadError(f"{folder}/config.json: invalid DSpark settings ({err})") from None
