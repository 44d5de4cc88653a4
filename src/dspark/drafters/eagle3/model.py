"""The Eagle3 draft model and its training-time-test (TTT) steps (docs/interop.md §Eagle3).

Shapes: L = sequence length, N = tokens, H = hidden size, F = len(target_layer_ids) * H,
V = vocabulary, Hq / Hkv / D = query heads / KV heads / head dim, T = ttt_length.

Architecture (DeepSpec ``Qwen3Eagle3Model``): fused features fc(concat target layers)
(F -> H, no bias) enter as the hidden state; each layer attends over
concat(input_layernorm(embed(token)), hidden_norm(hidden)) (2H wide into q/k/v) with
the hidden state as residual; logits = lm_head(norm(h)). embed_tokens and lm_head are
frozen copies of the target's. DeepSpec requires exactly 5 target layers; any strictly
increasing list works here (small targets have fewer).

Draft vocabulary (docs/training.md §Draft vocabulary), EAGLE-3's reduced LM head: with
``draft_vocab`` (W target token ids) lm_head holds those W rows of the target's and every
logit is over them (index w = token ``draft_vocab[w]``); the engines read it as
``draft_vocab_size`` + ``d2t``. Without one (DeepSpec's layout) W = V and w = token id.

Sequence convention. Position i pairs the target feature f_i (target saw x_0..x_i) with
token x_{i+1} and predicts x_{i+2}; its teacher is the target's distribution at i+1,
softmax(lm_head(target_last_hidden[i+1])). TTT step s (0-based) shifts the tokens by s
more, feeds back the previous step's output hidden state, and uses RoPE position i+s.
At step s, query i sees the step-0 keys j <= i (causal) and its own keys of steps
1..s (the "diagonal"); that is exactly what the autoregressive chain at inference
sees, so training and drafting agree. Loss (``loss.py``): sum_s decay^s * sum_i mask * softCE / L.

Names: ``embed_tokens``, ``fc``, ``layers.{i}.{self_attn,mlp,hidden_norm,input_layernorm,
post_attention_layernorm}``, ``norm``, ``lm_head``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dspark.drafters.checkpoint import (
    FROZEN_PREFIXES,
    arch_name,
    check_draft_vocab,
    check_fingerprint,
    check_layer_ids,
    check_target_fit,
    copy_frozen_embeddings,
    draft_spec_from,
    fill_restricted,
    finish_new_drafter,
    load_drafter_weights,
    read_draft_vocab,
    target_base_config,
    target_fingerprint,
    write_checkpoint,
)
from dspark.drafters.eagle3.config import Eagle3Config
from dspark.drafters.sample import TrainSample
from dspark.errors import IncompatibleModelsError, ModelLoadError
from dspark.modeling import cpu_kernels
from dspark.modeling.attention import attend_parts, plan_forward
from dspark.modeling.decoder import attend_per_request
from dspark.modeling.kv_cache import KVCache, KVPool
from dspark.modeling.layers import MLP, Attention, RMSNorm
from dspark.modeling.spec import DecoderSpec, spec_from_config
from dspark.modeling.weights import read_config


class Eagle3Layer(nn.Module):
    """Pre-norm decoder layer whose attention reads [input_layernorm(embed); hidden_norm(hidden)]."""

    def __init__(self, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        eps, off, H = spec.rms_norm_eps, spec.norm_offset, spec.hidden_size
        self.self_attn = Attention(spec, layer_idx, in_features=2 * H)
        self.mlp = MLP(spec)
        self.hidden_norm = RMSNorm(H, eps, off)
        self.input_layernorm = RMSNorm(H, eps, off)
        self.post_attention_layernorm = RMSNorm(H, eps, off)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) x2 -> (N, 2H)
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:  # (N, H), (N, Hq*D) -> (N, H)
        h = hidden + self.self_attn.o_proj(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))


# attention callback: (layer_idx, q (N, Hq, D), k (N, Hkv, D), v (N, Hkv, D)) -> (N, Hq*D)
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ttt_attention(
    attn: Attention,
    q: torch.Tensor,  # (L, Hq, D) queries of step s
    keys: list[torch.Tensor],  # s+1 tensors (L, Hkv, D): step 0 (causal), steps 1..s (diagonal)
    values: list[torch.Tensor],  # same
) -> torch.Tensor:  # (L, Hq*D)
    """Query i sees step-0 keys j <= i and the diagonal keys (position i) of steps 1..s."""
    L, Hq, D = q.shape
    Hkv = attn.num_kv_heads
    g = Hq // Hkv
    qh = q.transpose(0, 1).reshape(Hkv, g, L, D)  # (Hkv, g, L, D)
    k0, v0 = keys[0].transpose(0, 1), values[0].transpose(0, 1)  # (Hkv, L, D)
    scores = torch.einsum("hgld,hmd->hglm", qh, k0) * attn.scale  # (Hkv, g, L, L)
    diag = [(qh * k.transpose(0, 1)[:, None]).sum(-1) * attn.scale for k in keys[1:]]  # each (Hkv, g, L)
    if diag:
        scores = torch.cat([scores, torch.stack(diag, dim=-1)], dim=-1)  # (Hkv, g, L, L + s)
    if attn.softcap is not None:
        scores = torch.tanh(scores / attn.softcap) * attn.softcap
    future = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)  # (L, L) j > i
    scores[..., :L] = scores[..., :L].masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = probs[..., :L] @ v0[:, None]  # (Hkv, g, L, D)
    for t, v in enumerate(values[1:]):
        out = out + probs[..., L + t, None] * v.transpose(0, 1)[:, None]
    return out.reshape(Hq, L, D).transpose(0, 1).reshape(L, Hq * D)


@dataclass
class Eagle3Outputs:
    """The model's outputs on one sequence."""

    hidden: list[torch.Tensor]  # T tensors (L, H): output hidden state (pre-norm) of TTT step s at position i


def export_problems(cfg: Eagle3Config, target_spec: DecoderSpec) -> list[str]:
    """Why ``dspark export`` would refuse a drafter of these settings (training warns before spending the budget):
    both engines' ``LlamaForCausalLMEagle3`` fuse exactly 3 target layers into one Llama-shaped layer."""
    out = []
    n = len(cfg.target_layer_ids or [])
    if n != 3:
        out.append(f"model.target_layer_ids has {n} layers, the engines' LlamaForCausalLMEagle3 reads exactly 3 "
                   "(set 3 layers, as the smollm2-eagle3-export preset does)")
    if cfg.draft_num_hidden_layers != 1:
        out.append(f"model.draft_num_hidden_layers is {cfg.draft_num_hidden_layers}, the engines read one layer")
    if target_spec.qk_norm or target_spec.hidden_act != "silu" or target_spec.model_type.startswith("gemma"):
        out.append(f"its layer is {target_spec.model_type}-shaped, the engines' Eagle3 layer is Llama-shaped")
    return out


class Eagle3Model(nn.Module):
    def __init__(self, config: Eagle3Config, spec: DecoderSpec, base_config: dict[str, Any],
                 num_target_layers: int, target_name: str = "",
                 draft_vocab: torch.Tensor | list[int] | None = None) -> None:
        super().__init__()
        if config.target_layer_ids is None:
            raise ValueError("Eagle3Model needs resolved target_layer_ids; use from_target")
        if spec.sandwich_norms:
            raise ValueError(f"Eagle3 drafters are not supported for {spec.model_type} targets (sandwich norms)")
        self.config = config
        self.spec = spec
        self.base_config = base_config
        self.num_target_layers = num_target_layers
        self.target_name = target_name
        H, V = spec.hidden_size, spec.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(H, spec.rms_norm_eps, spec.norm_offset)
        # draft_vocab (W,) int64 target ids, a saved buffer
        if draft_vocab is not None:
            self.register_buffer("draft_vocab", check_draft_vocab(draft_vocab, V))
        else:
            self.draft_vocab = None
        W = V if draft_vocab is None else self.draft_vocab.numel()
        self.lm_head = nn.Linear(H, W, bias=False)  # the target's LM-head rows over the draft vocabulary
        # target_fingerprint() of the target it was made for: a checkpoint without the LM head (a draft vocabulary)
        # still refuses another target
        self.target_fingerprint: list[float] | None = None

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_target(cls, target, cfg: Eagle3Config, generator: torch.Generator | None = None,
                    draft_vocab: list[int] | torch.Tensor | None = None) -> "Eagle3Model":
        """A fresh drafter: random layer and fc, embed_tokens and lm_head copied from ``target`` and frozen (the
        LM head's rows over ``draft_vocab`` only, when given)."""
        layer_ids = cfg.target_layer_ids if cfg.target_layer_ids is not None else target.default_layer_ids()
        check_layer_ids(layer_ids, target.num_layers)
        cfg = dataclasses.replace(cfg, target_layer_ids=list(layer_ids))
        for problem in export_problems(cfg, target.spec):
            warnings.warn(f"this Eagle3 drafter will not export to SGLang or vLLM: {problem}", stacklevel=2)
        base = target_base_config(target)
        model = cls(cfg, draft_spec_from(target.spec, cfg.draft_num_hidden_layers), base, target.num_layers,
                    str(getattr(target, "name", "")), draft_vocab)
        model.target_fingerprint = target_fingerprint(target)
        return finish_new_drafter(model, target, base, generator)

    def copy_frozen_from(self, target) -> None:
        copy_frozen_embeddings(self, target)

    def restricted(self, vocab_ids: list[int] | torch.Tensor) -> "Eagle3Model":
        """A copy that drafts only ``vocab_ids`` (W target ids): the LM head's rows over them, the rest unchanged;
        its logits are this model's on those W tokens. ``IncompatibleModelsError`` if it has another vocabulary."""
        ids = check_draft_vocab(vocab_ids, self.spec.vocab_size)
        if self.draft_vocab is not None:
            if torch.equal(self.draft_vocab.cpu(), ids):
                return self
            raise IncompatibleModelsError(
                f"this Eagle3 checkpoint carries its own draft vocabulary of {self.draft_size} tokens; the "
                f"--draft-vocab file ({ids.numel()} tokens) differs: drop --draft-vocab")
        out = Eagle3Model(self.config, self.spec, self.base_config, self.num_target_layers, self.target_name, ids)
        out.target_fingerprint = self.target_fingerprint
        return fill_restricted(out, self, ids, ("lm_head.weight",))

    @classmethod
    def from_checkpoint(cls, folder: Path, target=None) -> "Eagle3Model":
        folder = Path(folder)
        cfg_dict = read_config(folder)
        if cfg_dict.get("target_layer_ids") is None:  # SpecForge/SGLang/vLLM EAGLE-3 (midlayer.*, d2t) included
            raise ModelLoadError(
                f"{folder}/config.json lacks 'target_layer_ids': not an Eagle3 checkpoint in DeepSpec's layout "
                "(an engine's LlamaForCausalLMEagle3 folder, with eagle_aux_hidden_state_layer_ids and midlayer.*, "
                "is not read here)")
        try:
            n_layers = int(cfg_dict.get("draft_num_hidden_layers", cfg_dict["num_hidden_layers"]))
            config = Eagle3Config(
                ttt_length=int(cfg_dict.get("ttt_length", 7)),
                step_loss_decay=float(cfg_dict.get("step_loss_decay", 0.8)),
                draft_num_hidden_layers=n_layers,
                target_layer_ids=[int(i) for i in cfg_dict["target_layer_ids"]],
                block_size=int(cfg_dict.get("block_size", cfg_dict.get("ttt_length", 7))),
            )
        except (ValueError, KeyError) as err:
            raise ModelLoadError(f"{folder}/config.json: invalid Eagle3 settings ({err})") from None
        spec = spec_from_config({**cfg_dict, "num_hidden_layers": n_layers})
        num_target_layers = cfg_dict.get("num_target_layers")
        if target is not None:
            check_target_fit(f"Eagle3 drafter {folder}", hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                             target_layer_ids=config.target_layer_ids, num_target_layers=num_target_layers,
                             target=target)
        if num_target_layers is None:
            num_target_layers = target.num_layers if target is not None else max(config.target_layer_ids) + 1
        base = {k: v for k, v in cfg_dict.items() if k not in _DRAFT_KEYS}
        vocab = read_draft_vocab(folder, cfg_dict, spec.vocab_size)
        model = cls(config, spec, base, int(num_target_layers), str(cfg_dict.get("target_model_name_or_path", "")),
                    vocab)
        model.target_fingerprint = cfg_dict.get("target_fingerprint")
        what = f"Eagle3 drafter {folder}"
        if target is not None:
            check_fingerprint(what, model.target_fingerprint, target)
        return load_drafter_weights(model, folder, what, target)

    # ----------------------------------------------------------------- pieces

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def draft_size(self) -> int:
        """W: the tokens the drafter can propose."""
        return self.lm_head.out_features

    def draft_tokens(self, index: torch.Tensor) -> torch.Tensor:  # (...,) w -> (...,) token ids
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, H)
        x = self.embed_tokens(ids)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # (N, F) -> (N, H)
        return self.fc(features.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, W)
        out = self.lm_head(self.norm(hidden))
        if self.spec.final_softcap:
            out = torch.tanh(out / self.spec.final_softcap) * self.spec.final_softcap
        return out

    def target_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:  # (N, H) final-normed -> (N, W)
        """The target's logits from its final-normed hidden state, through the shared (frozen) LM head (over
        the draft vocabulary: normalise with the target's full-vocabulary log-sum-exp, see loss.py)."""
        out = self.lm_head(target_hidden.to(self.lm_head.weight.dtype))
        if self.spec.final_softcap:
            out = torch.tanh(out / self.spec.final_softcap) * self.spec.final_softcap
        return out

    def run_layers(
        self,
        ids: torch.Tensor,  # (N,) input tokens
        hidden: torch.Tensor,  # (N, H) fused features (first step) or fed-back hidden states
        positions: torch.Tensor,  # (N,) RoPE positions
        attend: AttendFn,
    ) -> torch.Tensor:  # (N, H) output hidden (pre-norm), fed back at the next step
        embeds = self.embed(ids)
        for layer_idx, layer in enumerate(self.layers):
            x = layer.attn_input(embeds, hidden)  # (N, 2H)
            q = layer.self_attn.project_q(x, positions)
            k, v = layer.self_attn.project_kv(x, positions)
            hidden = layer.finish(hidden, attend(layer_idx, q, k, v))
        return hidden

    # ----------------------------------------------------------------- training

    def forward(self, sample: TrainSample, generator: torch.Generator | None = None) -> Eagle3Outputs:
        """The output hidden states of every TTT step (the loss is ``Eagle3Loss``'s job; no sampling here)."""
        del generator
        return Eagle3Outputs([h for h, _ in self._ttt_steps(sample)])

    def ttt_hidden_states(self, sample: TrainSample) -> list[torch.Tensor]:
        """Output hidden states of every TTT step, each (L, H) (tests, analysis)."""
        return self(sample).hidden

    def _ttt_steps(self, sample: TrainSample):
        """Yield (hidden (L, H), step ids) for s = 0..T-1."""
        L = sample.seq_len
        ids = sample.input_ids
        step_ids = torch.cat([ids[1:], ids.new_zeros(1)])  # (L,) position i holds x_{i+1}
        hidden = self.fuse(sample.target_features)  # (L, H)
        base_pos = torch.arange(L, device=ids.device)
        keys: list[list[torch.Tensor]] = [[] for _ in self.layers]
        values: list[list[torch.Tensor]] = [[] for _ in self.layers]

        def attend(layer_idx, q, k, v):
            keys[layer_idx].append(k)
            values[layer_idx].append(v)
            return ttt_attention(self.layers[layer_idx].self_attn, q, keys[layer_idx], values[layer_idx])

        for s in range(self.config.ttt_length):
            hidden = self.run_layers(step_ids, hidden, base_pos + s, attend)
            yield hidden, step_ids
            step_ids = torch.cat([step_ids[1:], step_ids.new_zeros(1)])

    def trainable_parameters(self) -> list[nn.Parameter]:
        frozen = {id(self.embed_tokens.weight), id(self.lm_head.weight)}
        return [p for p in self.parameters() if id(p) not in frozen]

    # ----------------------------------------------------------------- inference pieces

    def new_cache(self, capacity: int) -> KVCache:
        """An empty draft cache: a slot of the model's ``KVPool``, so that ``cached_forward`` attends every
        request of a batch in one call per layer."""
        s, w = self.spec, self.fc.weight
        pool = self.__dict__.get("_kv_pool")
        if pool is None or pool.keys.dtype != w.dtype or pool.keys.device != w.device:
            pool = KVPool(s.num_layers, s.num_kv_heads, s.head_dim, 1, capacity, w.dtype, device=w.device)
            self.__dict__["_kv_pool"] = pool  # a plain attribute: not a buffer, never in the state dict
        return pool.allocate(capacity)

    def cached_forward(
        self,
        ids: torch.Tensor,  # (N,) requests concatenated
        hidden: torch.Tensor,  # (N, H)
        seq_lens: list[int],
        caches: list[KVCache],
    ) -> torch.Tensor:  # (N, H)
        """Causal forward of new entries appended to each request's draft cache (positions = cache index). Caches
        of one pool (``new_cache``'s) are attended in one call per layer for the whole batch, long catch-up pieces
        on their own (``attention.plan_forward``), or, for bf16 decoding on the CPU where the C attention kernel takes the
        heads, every row in one kernel call (``cpu_kernels.attention``: each row computed alone, as the target's
        decoding rows); caches of different pools request by request."""
        for c, n in zip(caches, seq_lens):
            c.reserve(n)  # may grow the pool: before any layer reads it
        dev = ids.device
        kernel = (dev.type == "cpu" and self.fc.weight.dtype == torch.bfloat16 and not torch.is_grad_enabled()
                  and cpu_kernels.attention_fits(self.layers[0].self_attn))
        parts, layout = plan_forward(seq_lens, caches, dev, kernel=kernel)

        def attend(layer_idx, q, k, v):
            attn = self.layers[layer_idx].self_attn
            if parts is None:
                return attend_per_request(attn, layer_idx, q, k, v, layout, caches)
            return attend_parts(parts, layer_idx, q, k, v, attn.scale, attn.window, attn.softcap)

        out = self.run_layers(ids, hidden, layout.positions, attend)
        for c, n in zip(caches, seq_lens):
            c.length += n
        return out

    # ----------------------------------------------------------------- checkpoint

    def hf_config(self) -> dict[str, Any]:
        cfg, n = self.config, self.spec.num_layers
        out = copy.deepcopy(self.base_config)
        out.update({
            "architectures": [arch_name(self.spec.model_type, "Eagle3Model")],
            "num_hidden_layers": n,
            "layer_types": ["full_attention"] * n,
            "tie_word_embeddings": False,
            "target_layer_ids": list(cfg.target_layer_ids),
            "ttt_length": cfg.ttt_length,
            "step_loss_decay": cfg.step_loss_decay,
            "draft_num_hidden_layers": cfg.draft_num_hidden_layers,
            "target_model_name_or_path": self.target_name,
            "num_target_layers": self.num_target_layers,
            "block_size": cfg.block_size,
        })
        for key in ("draft_vocab_size", "target_fingerprint"):
            out.pop(key, None)
        if self.draft_vocab is not None:
            out["draft_vocab_size"] = self.draft_size
        if self.target_fingerprint:
            out["target_fingerprint"] = self.target_fingerprint
        return out

    def save_checkpoint(self, folder: Path, dtype: torch.dtype = torch.float32) -> None:
        """Write model.safetensors + config.json (DeepSpec layout; pass dtype=torch.bfloat16 for DeepSpec's bf16).
        With a draft vocabulary the frozen embed_tokens and lm_head are left out (the loader copies them from
        the target) and ``draft_vocab`` (W,) int64 is stored, as DSpark's checkpoints do."""
        state = self.state_dict()
        if self.draft_vocab is not None:
            state = {k: v for k, v in state.items() if not k.startswith(FROZEN_PREFIXES)}
        write_checkpoint(Path(folder), state, self.hf_config(), dtype)


_DRAFT_KEYS = {
    "architectures", "target_layer_ids", "ttt_length", "step_loss_decay", "draft_num_hidden_layers",
    "target_model_name_or_path", "num_target_layers", "block_size", "torch_dtype", "dtype", "draft_vocab_size",
    "target_fingerprint",
}
