"""What SGLang's and vLLM's drafter loaders read, restated from their source as small simulated loaders.

No engine code is copied; each function re-states, in our own words, the config keys (with their
precedence), the architecture strings, the weight names, stacking and shapes one loader reads, and the
checks it makes. A simulated load returns what the engine would end up with; it raises ``Refused`` where
the engine raises, and reports weights the engine would silently ignore (``ignored``) or parameters it
would leave uninitialised (``unfilled``), so a test can demand that neither happens.

Sources read (files named per function): sgl-project/sglang python/sglang/srt/models/{dspark,dflash,
llama_eagle3}.py, speculative/dflash_utils.py, speculative/dspark_components/dspark_config.py and
models/llama.py (set_eagle3_layers_to_capture); vllm-project/vllm vllm/model_executor/models/
{qwen3_dspark,qwen3_dflash}.py (vLLM 0.32.0's wheel for the DFlash loader), vllm/config/speculative.py and
vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py. vLLM's llama_eagle3.py was not read: its weights are
not checked here, only the aux-layer resolution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file


class Refused(Exception):
    """The engine's loader raises."""


@dataclass
class Loaded:
    arch: str
    gamma: int | None  # drafts per step the engine derives from the config (None: must be passed)
    capture_after: list[int]  # target layers whose OUTPUT the engine feeds the draft (our target_layer_ids)
    mask_token_id: int | None = None
    markov_rank: int = 0
    head_type: str | None = None
    confidence: bool = False
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # engine parameter -> loaded tensor
    ignored: list[str] = field(default_factory=list)  # checkpoint tensors the loader skips without a word
    unfilled: list[str] = field(default_factory=list)  # engine parameters nothing was loaded into
    draft_vocab_size: int | None = None


def _read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _backbone_params(cfg: dict, prefix: str, fc_in: int) -> dict[str, tuple[int, ...]]:
    """The Qwen3-shaped DFlash backbone both engines build: fused qkv and gate_up, per-head q/k norms."""
    H, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    D, inter = cfg.get("head_dim") or H // hq, cfg["intermediate_size"]
    shapes = {f"{prefix}fc.weight": (H, fc_in), f"{prefix}hidden_norm.weight": (H,), f"{prefix}norm.weight": (H,)}
    for i in range(n):
        p = f"{prefix}layers.{i}."
        shapes.update({
            p + "self_attn.qkv_proj.weight": ((hq + 2 * hkv) * D, H), p + "self_attn.o_proj.weight": (H, hq * D),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_up_proj.weight": (2 * inter, H), p + "mlp.down_proj.weight": (H, inter),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        })
    return shapes


_STACKED = {".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
            ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


def _load(shapes: dict[str, tuple[int, ...]], named: dict[str, torch.Tensor], out: Loaded,
          unknown_raises: bool) -> None:
    """Place checkpoint tensors into the engine's parameters; q/k/v and gate/up are concatenated shards."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in named.items():
        for part, (fused, idx) in _STACKED.items():
            if part in name and name.replace(part, fused) in shapes:
                shards.setdefault(name.replace(part, fused), {})[idx] = t
                break
        else:
            if name in shapes:
                if tuple(t.shape) != shapes[name]:
                    raise Refused(f"{name}: shape {tuple(t.shape)}, expected {shapes[name]}")
                out.params[name] = t
            elif unknown_raises:
                raise Refused(f"unexpected weight {name}")
            else:
                out.ignored.append(name)
    for name, parts in shards.items():
        t = torch.cat([parts[i] for i in sorted(parts)])
        if tuple(t.shape) != shapes[name]:
            raise Refused(f"{name}: stacked shape {tuple(t.shape)}, expected {shapes[name]}")
        out.params[name] = t
    out.unfilled = sorted(set(shapes) - set(out.params))


# ------------------------------------------------------------------ SGLang DSpark
# models/dspark.py (DSparkDraftMixin, build_markov_head, build_confidence_head, load_weights),
# models/dflash.py (DFlashDraftModel params and load_weights), dflash_utils.py parse_dflash_draft_config,
# dspark_components/dspark_config.py parse_dspark_draft_config and resolve_runtime_config.

SGLANG_DSPARK_ARCHS = ("Qwen3DSparkModel",)
SGLANG_HEAD_TYPES = ("vanilla", "gated", "rnn")


def sglang_dspark(folder: Path, target_vocab: int, verify_mode: str = "static") -> Loaded:
    cfg, named = _read(folder)
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in SGLANG_DSPARK_ARCHS:
        raise Refused(f"no SGLang DSpark model class for {arch!r}")
    nested, dspark = cfg.get("dflash_config") or {}, cfg.get("dspark_config") or {}
    text = cfg.get("text_config") or cfg
    block = cfg.get("dspark_block_size", nested.get("block_size", cfg.get("block_size")))
    layer_ids = cfg.get("dspark_target_layer_ids", nested.get("target_layer_ids", cfg.get("target_layer_ids")))
    mask = cfg.get("dspark_noise_token_id",
                   dspark.get("mask_token_id", text.get("mask_token_id", nested.get("mask_token_id"))))
    rank = int(cfg.get("dspark_markov_rank", dspark.get("markov_rank", text.get("markov_rank", 0))) or 0)
    head = cfg.get("dspark_markov_head_type", dspark.get("markov_head_type", text.get("markov_head_type")))
    if rank <= 0:
        raise Refused("DSpark requires markov_rank > 0")
    if head is None:
        raise Refused("DSpark requires markov_head_type when markov_rank > 0")
    if str(head).lower() not in SGLANG_HEAD_TYPES:
        raise Refused(f"unsupported markov_head_type {head!r}")
    if cfg.get("speculators_model_type") == "dspark":
        raise Refused("speculators slot convention (slot j predicts anchor + j)")
    if mask is None or int(mask) >= target_vocab:
        raise Refused(f"mask_token_id {mask} missing or outside the target vocabulary")
    if cfg.get("hidden_act", "silu") != "silu":
        raise Refused("only silu")
    head = str(head).lower()
    if layer_ids is None:  # SGLang would pick its own spread of layers: never what the draft was trained on
        raise Refused("no target_layer_ids: SGLang would choose layers itself")
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    out = Loaded(arch, int(block) if block is not None else None, [int(i) for i in layer_ids], int(mask), rank, head)
    shapes = _backbone_params(cfg, "", len(layer_ids) * H)
    shapes.update({"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank)})
    if head == "gated":
        shapes.update({"markov_head.gate_proj.weight": (rank, H + rank), "markov_head.gate_proj.bias": (rank,)})
    if head == "rnn":
        shapes.update({"markov_head.joint_proj.weight": (3 * rank, 2 * rank + H),
                       "markov_head.joint_proj.bias": (3 * rank,)})
    if verify_mode != "static":  # the head is built whatever enable_confidence_head says
        width = H + (rank if cfg.get("confidence_head_with_markov", rank > 0) else 0)
        shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
        out.confidence = True
    kept = {}
    for name, t in named.items():
        if name.startswith(("embed_tokens.", "lm_head.", "rotary_emb.")):
            continue  # shared from the target by design, not a silent drop
        if name.startswith("confidence_head.") and not out.confidence:
            continue
        if name.startswith("markov_head.") and name not in shapes:
            raise Refused(f"unexpected markov weight {name}")
        kept[name] = t
    _load(shapes, kept, out, unknown_raises=False)
    missing_conf = [k for k in out.unfilled if k.startswith("confidence_head.")]
    if missing_conf:
        raise Refused(f"confidence head enabled but the checkpoint lacks {missing_conf}")
    return out


# ------------------------------------------------------------------ vLLM DSpark
# config/speculative.py (method detection, num_speculative_tokens), models/qwen3_dspark.py
# (Qwen3DSparkModel heads, Qwen3DSparkForCausalLM.load_weights), models/qwen3_dflash.py (backbone, mask id),
# spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config.

def vllm_aux_layers(cfg: dict) -> list[int] | None:
    """The target layers whose input vLLM captures (layer i's input = layer i - 1's output)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(cfg.get("dflash_config"), dict):
        ids = [i + 1 for i in (cfg["dflash_config"].get("target_layer_ids") or [])]
    if not ids and cfg.get("dspark_target_layer_ids"):
        ids = [i + 1 for i in cfg["dspark_target_layer_ids"]]
    if not ids and cfg.get("target_layer_ids"):
        ids = [i + 1 for i in cfg["target_layer_ids"]]
    return list(ids) if ids else None


def vllm_dspark(folder: Path, target_vocab: int) -> Loaded:
    cfg, named = _read(folder)
    archs = cfg.get("architectures") or []
    if "Qwen3DSparkModel" not in archs and not ("DSparkDraftModel" in archs and cfg.get("model_type") == "qwen3"):
        raise Refused(f"method dspark is not detected for {archs}")
    aux = vllm_aux_layers(cfg)
    if not aux:
        raise Refused("no aux layers in the draft config")
    nested = {**(cfg.get("eagle_config") or {}), **(cfg.get("dflash_config") or {})}
    mask = nested.get("mask_token_id", cfg.get("mask_token_id"))
    H, V, rank = cfg["hidden_size"], cfg["vocab_size"], int(cfg.get("markov_rank") or 0)
    W = cfg.get("draft_vocab_size") or V
    out = Loaded("Qwen3DSparkModel", None, [i - 1 for i in aux], mask, rank, "vanilla", draft_vocab_size=W)
    shapes = _backbone_params(cfg, "model.", len(aux) * cfg.get("target_hidden_size", H))
    shapes.update({"model.markov_head.markov_w1.weight": (V, rank), "model.markov_head.markov_w2.weight": (W, rank)})
    if cfg.get("enable_confidence_head", False):
        width = H + (rank if cfg.get("confidence_head_with_markov", False) else 0)
        shapes.update({"model.confidence_head.proj.weight": (1, width), "model.confidence_head.proj.bias": (1,)})
    reduced = W < target_vocab
    renamed, has = {}, set()
    for name, t in named.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
            has.add("d2t")
        elif "lm_head" not in name:
            name = "model." + name
        has.update(k for k in ("embed_tokens", "lm_head", "confidence_head") if k in name)
        renamed[name] = t
    if reduced and "lm_head" not in has:
        raise Refused("reduced-vocabulary DSpark needs lm_head weights")
    if reduced and "d2t" not in has:
        raise Refused("reduced-vocabulary DSpark needs a d2t mapping")
    if reduced:
        shapes["draft_id_to_target_id"] = (W,)
    if "lm_head" in has:
        shapes["lm_head.weight"] = (W, H)
    if "embed_tokens" in has:
        shapes["model.embed_tokens.weight"] = (V, H)
    if "confidence_head" not in has:  # dropped when the checkpoint has none
        for k in [k for k in shapes if "confidence_head" in k]:
            del shapes[k]
        out.confidence = False
    else:
        out.confidence = "model.confidence_head.proj.weight" in shapes
    _load(shapes, renamed, out, unknown_raises=True)
    return out


# ------------------------------------------------------------------ vLLM DFlash
# vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3Model, DFlashQwen3ForCausalLM.__init__/load_weights),
# vllm/config/speculative.py (method "dflash" detected from an architecture starting with "DFlash").

def vllm_dflash(folder: Path, target_vocab: int) -> Loaded:
    """vLLM's DFlash drafter: Qwen3-shaped backbone, anchor + k slots (query [bonus, mask x K], drafts from the K
    mask slots); mask id and 0-based target layers in ``dflash_config``; lm_head and embed_tokens shared with the
    target unless the checkpoint ships them; a draft vocabulary needs lm_head (W rows) and d2t."""
    cfg, named = _read(folder)
    archs = cfg.get("architectures") or [""]
    if archs[0] != "DFlashDraftModel":
        raise Refused(f"method dflash is not detected for {archs}")
    if cfg.get("model_type") != "qwen3":
        raise Refused(f"DFlashDraftModel builds a Qwen3 config; model_type {cfg.get('model_type')!r}")
    nested = cfg.get("dflash_config") or {}
    if nested.get("sample_from_anchor"):
        raise Refused("sample_from_anchor=True is not supported for DFlash")
    aux = vllm_aux_layers({"dflash_config": nested})
    if not aux:
        raise Refused("no dflash_config.target_layer_ids")
    mask = nested.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise Refused("no dflash_config.mask_token_id")
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    W = cfg.get("draft_vocab_size") or V
    out = Loaded("DFlashDraftModel", None, [i - 1 for i in aux], int(mask), draft_vocab_size=W)
    shapes = _backbone_params(cfg, "model.", len(aux) * (cfg.get("target_hidden_size") or H))
    renamed, has = {}, set()
    for name, t in named.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
            has.add("d2t")
        elif "lm_head" not in name:
            name = "model." + name
        has.update(k for k in ("embed_tokens", "lm_head") if k in name)
        renamed[name] = t
    if W != target_vocab:
        if not {"lm_head", "d2t"} <= has:
            raise Refused("a draft vocabulary needs its lm_head rows and d2t")
        shapes["draft_id_to_target_id"] = (W,)
    if "lm_head" in has:
        shapes["lm_head.weight"] = (W, H)
    if "embed_tokens" in has:
        shapes["model.embed_tokens.weight"] = (V, H)
    _load(shapes, renamed, out, unknown_raises=True)
    return out


# ------------------------------------------------------------------ Eagle3
# SGLang models/llama_eagle3.py (LlamaForCausalLMEagle3, load_weights skips unknown names) and models/llama.py
# set_eagle3_layers_to_capture (captures layer id + 1's input); vLLM eagle3_utils.py for the aux ids only.

def sglang_eagle3(folder: Path) -> Loaded:
    cfg, named = _read(folder)
    if (cfg.get("architectures") or [""])[0] != "LlamaForCausalLMEagle3":
        raise Refused("not LlamaForCausalLMEagle3")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise Refused("no eagle_aux_hidden_state_layer_ids: SGLang would capture [2, L // 2, L - 3]")
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    D, inter = cfg.get("head_dim") or H // hq, cfg["intermediate_size"]
    W = cfg.get("draft_vocab_size") or V
    shapes = {
        "model.embed_tokens.weight": (V, H), "model.fc.weight": (H, 3 * cfg.get("target_hidden_size", H)),
        "model.midlayer.self_attn.qkv_proj.weight": ((hq + 2 * hkv) * D, 2 * H),
        "model.midlayer.self_attn.o_proj.weight": (H, hq * D),
        "model.midlayer.mlp.gate_up_proj.weight": (2 * inter, H), "model.midlayer.mlp.down_proj.weight": (H, inter),
        "model.midlayer.hidden_norm.weight": (H,), "model.midlayer.input_layernorm.weight": (H,),
        "model.midlayer.post_attention_layernorm.weight": (H,), "model.norm.weight": (H,), "lm_head.weight": (W, H),
    }
    out = Loaded("LlamaForCausalLMEagle3", None, [int(i) for i in ids], draft_vocab_size=W)
    # d2t (draft id -> target id offsets) becomes hot_token_id = d2t + arange(W); t2d is skipped
    renamed = {(k if k.startswith("lm_head") else "model." + k): t for k, t in named.items()
               if "t2d" not in k and "d2t" not in k}
    _load(shapes, renamed, out, unknown_raises=False)
    d2t = next((t for k, t in named.items() if "d2t" in k), None)
    if d2t is not None:
        if d2t.shape != (W,):
            raise Refused(f"d2t: shape {tuple(d2t.shape)}, expected ({W},)")
        out.params["hot_token_id"] = d2t + torch.arange(W)
    return out


def vllm_eagle3_layers(folder: Path) -> list[int]:
    cfg, _ = _read(folder)
    return [i - 1 for i in vllm_aux_layers(cfg) or []]


# ------------------------------------------------------------------ SGLang DSpark drafting (greedy)
# models/dspark.py: VanillaMarkov / GatedMarkovHead / RNNHead (compute_step_bias, _rnn_step, sample_block),
# run_markov_block, DSparkDraftMixin.compute_base_logits, DSparkConfidenceHead.forward and the worker's
# markov_embed_stack = W1 rows of [anchor, s_0 .. s_{G-2}]. Shapes: N blocks, G slots, H hidden, V vocabulary.

def sglang_dspark_greedy(
    loaded: Loaded,
    lm_head: torch.Tensor,  # (V, H) the target's LM head, shared by SGLang
    hidden: torch.Tensor,  # (N, G, H) the backbone's final-normed hidden states of the blocks
    anchor: torch.Tensor,  # (N,) the anchor token ids (x_{-1})
    dtype: torch.dtype = torch.float32,  # the engine's dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # drafts (N, G), step logits (N, G, V), conf (N, G)
    """What SGLang drafts greedily from ``loaded`` (sglang_dspark's result): U_k + B_k over the full vocabulary,
    argmax left to right, each draft the next step's previous token; the raw confidence logits if loaded."""
    p = {k: v.to(dtype) for k, v in loaded.params.items()}
    w1, w2 = p["markov_head.markov_w1.weight"], p["markov_head.markov_w2.weight"]  # (V, r) each
    hidden = hidden.to(dtype)
    base = hidden @ lm_head.to(dtype).T  # (N, G, V)
    N, G, _ = hidden.shape
    state = torch.zeros(N, loaded.markov_rank, dtype=dtype)  # the RNN's s_0 = 0
    prev, drafts, logits = anchor.long(), [], []
    for k in range(G):
        e, h = w1[prev], hidden[:, k]  # (N, r), (N, H)
        if loaded.head_type == "vanilla":
            u = e
        elif loaded.head_type == "gated":
            gate = torch.sigmoid(torch.cat([h, e], -1) @ p["markov_head.gate_proj.weight"].T
                                 + p["markov_head.gate_proj.bias"])
            u = gate * e
        else:
            z = torch.cat([state, e, h], -1) @ p["markov_head.joint_proj.weight"].T + p["markov_head.joint_proj.bias"]
            g, c, o = z.chunk(3, -1)
            g = torch.sigmoid(g)
            state = g * state + (1.0 - g) * torch.tanh(c)
            u = torch.tanh(o)
        step = base[:, k] + u @ w2.T  # (N, V)
        prev = step.argmax(-1)
        drafts.append(prev)
        logits.append(step)
    drafts_t = torch.stack(drafts, 1)  # (N, G)
    conf = None
    if loaded.confidence:
        prev_seq = torch.cat([anchor.long()[:, None], drafts_t[:, :-1]], 1)  # (N, G)
        feats = hidden
        if loaded.params["confidence_head.proj.weight"].shape[1] > hidden.shape[-1]:  # with_markov
            feats = torch.cat([hidden, w1[prev_seq]], -1)
        conf = (feats.float() @ loaded.params["confidence_head.proj.weight"].float().T
                + loaded.params["confidence_head.proj.bias"].float())[..., 0]  # SGLang's head runs in fp32
    return drafts_t, torch.stack(logits, 1), conf
