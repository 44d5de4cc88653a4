"""`dspark export --to sglang|vllm CKPT OUT`: a drafter checkpoint rewritten into what a serving engine loads.

Shapes: V = target vocabulary, W = draft vocabulary, H = hidden size, r = Markov rank.

What each engine loads was read from its source (docs/interop.md §SGLang, §vLLM, docs/serving-at-scale.md):

- DSpark (and DFlash, as a DSpark whose Markov head is zero): both engines load ``Qwen3DSparkModel``, a
  Qwen3-shaped backbone (``draft_layer`` "qwen3", or any drafter of a Qwen3 target) (q_norm/k_norm, SiLU) with DeepSpec's slot convention (slot k predicts anchor + k + 1),
  ``markov_rank > 0``, the target's embedding and LM head. SGLang knows the ``vanilla``, ``gated`` and ``rnn``
  heads, vLLM only ``vanilla``. SGLang drafts over the full vocabulary: a draft vocabulary goes there as one
  more Markov rank that masks the other tokens (``mask_outside_draft_vocab``, the same drafts); vLLM takes it
  as ``draft_vocab_size`` + ``lm_head`` (W rows) + ``d2t`` (draft id -> target id offsets) with ``markov_w1``
  over all V rows.
- DFlash in the anchor + k convention (``slot_offset`` 1: slot k predicts anchor + k, slot 0 drafts nothing):
  vLLM loads ``DFlashDraftModel`` (Qwen3-shaped, ``dflash_config.mask_token_id`` / ``target_layer_ids``), on its
  CPU runner too; SGLang's DSpark reads only DeepSpec's convention, so it is refused there.
- Eagle3: both engines load ``LlamaForCausalLMEagle3``: one Llama-shaped layer named ``midlayer``, ``fc``
  over exactly 3 target layers.

Anything else is refused with the reason in one line (``IncompatibleModelsError``) naming the field, the
convention and the engine version the loaders were read from: a drafter with target-family (non-Qwen3) draft
layers (``draft_layer``), a convention the engine does not read (``slot_offset``), a head type or side file the
engine does not read. Every floating tensor is
written as bf16. ``plan_export`` builds the files in memory (tests read them), ``export_for_engine`` writes them
and returns the exact launch command.
"""

from __future__ import annotations

import copy
import json
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark.errors import IncompatibleModelsError

ENGINES = ("sglang", "vllm")
#: the engine versions whose loaders these exports follow (docs/interop.md §vLLM, §SGLang)
ENGINE_VERSIONS = {"sglang": "SGLang 0.5.23", "vllm": "vLLM 0.32.0"}
DSPARK_ARCH = "Qwen3DSparkModel"  # SGLang models/dspark.py EntryClass, vLLM registry -> qwen3_dspark.py
DFLASH_ARCH = "DFlashDraftModel"  # vLLM registry -> qwen3_dflash.py DFlashQwen3ForCausalLM (CPU and GPU runners)
EAGLE3_ARCH = "LlamaForCausalLMEagle3"  # SGLang models/llama_eagle3.py, vLLM llama_eagle3.py
HEAD_TYPES = {"sglang": ("vanilla", "gated", "rnn"), "vllm": ("vanilla",)}
#: the Markov bias of a token outside the draft vocabulary in an SGLang export (``mask_outside_draft_vocab``):
#: a power of two, so exact in bf16 and fp16; U_k + OUTSIDE_BIAS stays finite in fp16 (|U_k| < 49,000, max 65,504)
#: and exp((OUTSIDE_BIAS + U_k - max_k U_k) / T) is exactly 0 in fp32, bf16 and fp16 (their smallest positive
#: number is above e^-104) while the best outside token's lead over the best draft token is below 16,384 - 104 T
OUTSIDE_BIAS = -2.0 ** 14
#: a pre-activation whose sigmoid and tanh are exactly 1 in fp32, bf16 and fp16 (1 - sigmoid(64) = 1.6e-28)
SATURATE = 64.0
SPS_FILE, STS_FILE = "dspark_sps.json", "sts.json"  # the side files, written beside the weights

#: config.json keys of ours that no engine reads and that could mislead one (nested slot/layer fields)
_DROP_KEYS = ("dflash_config", "eagle_config", "eagle_aux_hidden_state_layer_ids", "speculators_model_type",
              "target_fingerprint", "draft_vocab_size", "is_causal", "auto_map")


@dataclass
class ExportPlan:
    """The files of an export: config.json, the tensors of model.safetensors, side files, notes."""

    engine: str
    kind: str  # "dspark" | "dflash" | "eagle3": vLLM's method name
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    block_size: int  # drafts per step (gamma)
    has_confidence: bool = False
    side_files: dict[str, Path] = field(default_factory=dict)  # name in OUT -> source file
    notes: list[str] = field(default_factory=list)


def _refuse(engine: str, ckpt: Path, reason: str) -> IncompatibleModelsError:
    return IncompatibleModelsError(f"cannot export {ckpt} to {engine} (loaders read from {ENGINE_VERSIONS[engine]}): "
                                   f"{reason}")


def plan_export(ckpt: str | Path, engine: str, sps_table: str | Path | None = None,
                sts: str | Path | None = None, target_folder: str | Path | None = None) -> ExportPlan:
    """What ``export_for_engine`` would write, or IncompatibleModelsError with the reason in one line."""
    from dspark.drafters.registry import DrafterKind, checkpoint_kind
    from dspark.modeling.weights import read_config

    ckpt = Path(ckpt)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    cfg = read_config(ckpt)
    kind = checkpoint_kind(ckpt)
    if kind == DrafterKind.DSPARK:
        plan = _plan_dspark(ckpt, engine, cfg, target_folder)
    elif kind == DrafterKind.EAGLE3:
        plan = _plan_eagle3(ckpt, engine, cfg, target_folder)
    else:
        raise _refuse(engine, ckpt, f"architecture {(cfg.get('architectures') or ['?'])[0]!r} is not a DSpark, "
                      "DFlash or Eagle3 drafter (an independent draft LM is served as the engine's draft_model)")
    _add_side_files(plan, ckpt, sps_table, sts)
    return plan


def _state(ckpt: Path) -> dict[str, torch.Tensor]:
    from dspark.drafters.checkpoint import read_checkpoint_state

    return read_checkpoint_state(ckpt)


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def _vllm_draft_vocab(out: dict, conf_cfg: dict, notes: list[str], state: dict, ids: torch.Tensor,
                      target_folder, engine: str, ckpt) -> None:
    """A draft vocabulary as vLLM (and SGLang's Eagle3) reads it: ``lm_head`` (W rows of the target's), ``d2t`` and
    ``draft_vocab_size``."""
    out["lm_head.weight"] = _draft_lm_head(state, ids, target_folder, engine, ckpt)  # (W, H)
    out["d2t"] = ids - torch.arange(ids.numel())  # (W,) int64: target id = draft id + d2t[draft id]
    conf_cfg["draft_vocab_size"] = int(ids.numel())
    notes.append(f"draft vocabulary of {ids.numel()} tokens written as {engine}'s draft_vocab_size + d2t")


def _draft_lm_head(state: dict[str, torch.Tensor], ids: torch.Tensor, target_folder: str | Path | None,
                   engine: str, ckpt: Path) -> torch.Tensor:  # (W, H): the target's LM-head rows of the draft vocabulary
    if "lm_head.weight" in state:
        return state["lm_head.weight"]
    if target_folder is None:
        raise _refuse(engine, ckpt, "it leaves out the frozen LM head, whose draft-vocabulary rows the engine "
                      "needs: pass --target-folder (the target's HF folder)")
    from dspark.modeling.weights import load_state_dict

    target = load_state_dict(Path(target_folder))
    head = target.get("lm_head.weight", target.get("model.embed_tokens.weight"))  # tied: the input embedding
    return head.float()[ids]


def _target_tensor(target_folder: str | Path | None, name: str, engine: str, ckpt: Path) -> torch.Tensor:
    """The target's tensor ``name`` (an Eagle3 export with a draft vocabulary needs its input embedding)."""
    if target_folder is None:
        raise _refuse(engine, ckpt, f"it leaves out the frozen {name}, which the engine's Eagle3 layer reads: "
                      "pass --target-folder (the target's HF folder)")
    from dspark.modeling.weights import load_state_dict

    return load_state_dict(Path(target_folder))[name].float()


def _plan_dspark(ckpt: Path, engine: str, cfg: dict[str, Any], target_folder: str | Path | None) -> ExportPlan:
    from dspark.drafters.dspark.config import config_from_checkpoint
    from dspark.modeling.spec import spec_from_config

    config = config_from_checkpoint(cfg, ckpt)
    spec = spec_from_config(cfg)
    arch = DFLASH_ARCH if config.slot_offset else DSPARK_ARCH
    if spec.model_type != "qwen3" or not spec.qk_norm or spec.hidden_act != "silu":
        raise _refuse(engine, ckpt, f"draft_layer {config.draft_layer!r}: its backbone is {spec.model_type}-shaped; "
                      f"{engine}'s {arch} is Qwen3-shaped (q_norm/k_norm, SiLU): train with model.draft_layer=qwen3")
    if config.slot_offset:
        if engine == "sglang":
            raise _refuse(engine, ckpt, "slot_offset 1: its slot k predicts anchor + k (the DFlash anchor + k "
                          f"convention); SGLang's {DSPARK_ARCH} reads slot k as anchor + k + 1 (DeepSpec's): train "
                          "with model.slot_offset=0 for SGLang")
        if not config.is_dflash:
            raise _refuse(engine, ckpt, "slot_offset 1 with a Markov or confidence head: vLLM reads the anchor + k "
                          f"convention only as {DFLASH_ARCH}, which has neither head (its DSpark reads slot k as "
                          "anchor + k + 1): train a DFlash drafter with model.slot_offset=1, or DSpark with 0")
    if config.markov_rank and config.markov_head_type not in HEAD_TYPES[engine]:
        raise _refuse(engine, ckpt, f"markov_head_type {config.markov_head_type!r}: {engine} loads "
                      f"{', '.join(HEAD_TYPES[engine])} only")
    state = _state(ckpt)
    notes = []
    V, H = spec.vocab_size, spec.hidden_size
    if not config.mask_token_id < V:
        raise _refuse(engine, ckpt, f"mask_token_id {config.mask_token_id} is outside the vocabulary of {V}")
    if config.slot_offset:
        return _plan_dflash(ckpt, engine, cfg, config, spec, state, target_folder)
    rank, head_type = config.markov_rank, config.markov_head_type
    if rank == 0:  # DFlash = DSpark with B_k = 0: a rank-1 zero Markov head drafts exactly U_k
        rank, head_type = 1, "vanilla"
        W = V if state.get("draft_vocab") is None else state["draft_vocab"].numel()
        state["markov_head.markov_w1.weight"] = torch.zeros(W, 1)
        state["markov_head.markov_w2.weight"] = torch.zeros(W, 1)
        notes.append("DFlash drafter written as DSpark with a zero rank-1 Markov head (same drafts: B_k = 0)")
    out = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))}
    out.pop("draft_vocab", None)
    conf_cfg = copy.deepcopy(cfg)
    for key in _DROP_KEYS:
        conf_cfg.pop(key, None)
    ids = None if state.get("draft_vocab") is None else state["draft_vocab"].long()  # (W,) target ids
    if ids is not None and engine == "sglang":  # SGLang drafts over the target's full LM head
        rank = mask_outside_draft_vocab(out, ids, V, rank, head_type,
                                        config.enable_confidence_head and config.confidence_head_with_markov)
        notes.append(f"draft vocabulary of {ids.numel()} tokens written over SGLang's full vocabulary: one more "
                     f"Markov rank ({rank}) adds {OUTSIDE_BIAS:g} to the other {V - ids.numel()} tokens' logits, "
                     "so they get probability 0 and the drafts are ours")
    elif ids is not None:
        w1 = torch.zeros(V, rank)  # (V, r): zero for a previous token outside the draft vocabulary, as trained
        w1[ids] = out["markov_head.markov_w1.weight"].float()
        out["markov_head.markov_w1.weight"] = w1
        _vllm_draft_vocab(out, conf_cfg, notes, state, ids, target_folder, engine, ckpt)
    n = spec.num_layers
    conf_cfg.update({
        "architectures": [DSPARK_ARCH], "model_type": "qwen3", "num_hidden_layers": n,
        "layer_types": ["full_attention"] * n, "tie_word_embeddings": False, "hidden_size": H, "vocab_size": V,
        "num_target_layers": int(cfg.get("num_target_layers") or max(config.target_layer_ids) + 1),
        "block_size": config.block_size, "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids), "markov_rank": rank, "markov_head_type": head_type,
        "enable_confidence_head": config.enable_confidence_head, "torch_dtype": "bfloat16", "dtype": "bfloat16",
    })
    conf_cfg.pop("confidence_head_with_markov", None)
    if config.enable_confidence_head:
        conf_cfg["confidence_head_with_markov"] = config.confidence_head_with_markov
    if rank == 1 and config.markov_rank == 0 and engine == "vllm":
        notes.append(f"vLLM runs {DSPARK_ARCH} on its GPU runner only; for its DFLASH method ({DFLASH_ARCH}, CPU "
                     "too) train with model.slot_offset=1 (the anchor + k convention)")
    return ExportPlan(engine, "dspark", conf_cfg, _bf16(out), config.block_size,
                      config.enable_confidence_head, notes=notes)


def mask_outside_draft_vocab(out: dict[str, torch.Tensor], ids: torch.Tensor, V: int, rank: int, head_type: str,
                             conf_with_markov: bool) -> int:
    """Rewrite the Markov head of a draft-vocabulary checkpoint (W rows) over the full vocabulary V with one
    extra rank dimension that masks the tokens outside the draft vocabulary; returns the new rank r + 1.

    The extra dimension of the latent u_k is 1 at every step and every previous token, and W2's extra column
    is 0 for draft tokens and ``OUTSIDE_BIAS`` for the others, so B_k = W2 u_k (eq. 5) is the trained bias on
    the W draft tokens and ``OUTSIDE_BIAS`` elsewhere: softmax(U_k + B_k) over V is exactly our draft
    distribution over W, 0 outside (docs/interop.md §Draft vocabulary in SGLang). Per head type:

    - vanilla: u_k = W1[x_{k-1}], so W1's extra column is 1 for every row (outside rows stay 0 elsewhere:
      a previous token outside the draft vocabulary has a zero embedding, as trained);
    - gated: u_k = sigmoid(gate_proj([h_k; W1[x_{k-1}]])) * W1[x_{k-1}]: gate_proj gets a zero input column
      (the extra embedding dimension) and an output row of zero weights with bias ``SATURATE`` (gate 1);
    - rnn: z = [s_{k-1}; W1[x_{k-1}]; h_k], u_k = tanh(W_o z) (eq. 6): joint_proj gets zero input columns for
      the extra state and embedding dimensions and one extra output row per chunk, zero weights, the output
      chunk's with bias ``SATURATE`` (u = tanh(64) = 1); the extra state stays 0 and is never read;
    - the confidence head (eq. 7) reads W1[x_{k-1}] when ``conf_with_markov``: a zero extra input column.
    """
    r, r1 = rank, rank + 1
    inside = torch.zeros(V, dtype=torch.bool)
    inside[ids] = True
    w1 = torch.zeros(V, r1)  # (V, r + 1)
    w1[ids, :r] = out["markov_head.markov_w1.weight"].float()  # (W, r) trained rows, in draft order
    w1[:, r] = 1.0
    w2 = torch.zeros(V, r1)  # (V, r + 1)
    w2[ids, :r] = out["markov_head.markov_w2.weight"].float()  # (W, r)
    w2[~inside, r] = OUTSIDE_BIAS
    out["markov_head.markov_w1.weight"], out["markov_head.markov_w2.weight"] = w1, w2
    if head_type == "gated":
        g, b = out["markov_head.gate_proj.weight"].float(), out["markov_head.gate_proj.bias"].float()  # (r, H + r), (r,)
        H = g.shape[1] - r
        gate = torch.zeros(r1, H + r1)  # (r + 1, H + r + 1): input [h_k; e_k], e_k with its extra dimension last
        gate[:r, :H + r] = g
        bias = torch.cat([b, torch.tensor([SATURATE])])  # (r + 1,)
        out["markov_head.gate_proj.weight"], out["markov_head.gate_proj.bias"] = gate, bias
    elif head_type == "rnn":
        j, b = out["markov_head.joint_proj.weight"].float(), out["markov_head.joint_proj.bias"].float()  # (3r, 2r + H)
        H = j.shape[1] - 2 * r
        joint = torch.zeros(3 * r1, 2 * r1 + H)  # (3(r + 1), 2(r + 1) + H): chunks gate, cand, out of r + 1 rows
        bias = torch.zeros(3 * r1)
        cols = torch.cat([torch.arange(r), r1 + torch.arange(r), 2 * r1 + torch.arange(H)])  # s, e, h columns
        for c in range(3):
            joint[c * r1:c * r1 + r, cols] = j[c * r:(c + 1) * r]
            bias[c * r1:c * r1 + r] = b[c * r:(c + 1) * r]
        bias[3 * r1 - 1] = SATURATE  # the output chunk's extra row: u = tanh(SATURATE) = 1
        out["markov_head.joint_proj.weight"], out["markov_head.joint_proj.bias"] = joint, bias
    if conf_with_markov:
        w = out["confidence_head.proj.weight"].float()  # (1, H + r): input [h_k; W1[x_{k-1}]]
        out["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, 1)], dim=1)  # (1, H + r + 1)
    return r1


def _plan_dflash(ckpt: Path, engine: str, cfg: dict[str, Any], config, spec, state: dict[str, torch.Tensor],
                 target_folder: str | Path | None) -> ExportPlan:
    """An anchor + k DFlash drafter as vLLM's ``DFlashDraftModel``: query [bonus, mask x K] at positions
    anchor..anchor+K, drafts from the K mask slots; ``dflash_config`` holds mask_token_id and the 0-based
    target_layer_ids (vLLM adds 1 itself, as we capture layer outputs). The target's embedding and full LM head
    are shared by vLLM; a draft vocabulary goes as ``draft_vocab_size`` + ``lm_head`` (W rows) + ``d2t``."""
    out = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))}
    out.pop("draft_vocab", None)
    conf_cfg = copy.deepcopy(cfg)
    for key in (*_DROP_KEYS, "slot_offset", "draft_layer", "num_anchors", "markov_rank", "markov_head_type",
                "enable_confidence_head", "confidence_head_with_markov", "mask_token_id", "target_layer_ids"):
        conf_cfg.pop(key, None)
    notes = []
    ids = state.get("draft_vocab")
    if ids is not None:
        _vllm_draft_vocab(out, conf_cfg, notes, state, ids.long(), target_folder, engine, ckpt)
    n = spec.num_layers
    conf_cfg.update({
        "architectures": [DFLASH_ARCH], "model_type": "qwen3", "num_hidden_layers": n,
        "layer_types": ["full_attention"] * n, "tie_word_embeddings": False,
        "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size, "target_hidden_size": spec.hidden_size,
        "num_target_layers": int(cfg.get("num_target_layers") or max(config.target_layer_ids) + 1),
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    })
    return ExportPlan(engine, "dflash", conf_cfg, _bf16(out), config.num_drafts, notes=notes)


def _plan_eagle3(ckpt: Path, engine: str, cfg: dict[str, Any], target_folder: str | Path | None) -> ExportPlan:
    """A one-layer Eagle3 drafter as both engines' ``LlamaForCausalLMEagle3`` (``midlayer.*``); a draft vocabulary
    goes as ``draft_vocab_size`` + ``lm_head`` (W rows) + ``d2t``, which both engines read, with the target's
    input embedding written beside it (the checkpoint leaves the frozen one out)."""
    from dspark.modeling.spec import spec_from_config

    n_layers = int(cfg.get("draft_num_hidden_layers", cfg.get("num_hidden_layers", 1)))
    spec = spec_from_config({**cfg, "num_hidden_layers": n_layers})
    ids = [int(i) for i in cfg.get("target_layer_ids") or []]
    if len(ids) != 3:
        raise _refuse(engine, ckpt, f"its fc reads {len(ids)} target layers; {engine}'s {EAGLE3_ARCH} reads exactly 3 "
                      "(train with model.target_layer_ids of 3 layers)")
    if spec.qk_norm or spec.hidden_act != "silu" or spec.model_type.startswith("gemma"):
        raise _refuse(engine, ckpt, f"its layer is {spec.model_type}-shaped (q_norm/k_norm or another activation); "
                      f"{engine}'s {EAGLE3_ARCH} layer is Llama-shaped and would drop those weights")
    if n_layers != 1:
        raise _refuse(engine, ckpt, f"it has {n_layers} layers; {engine}'s {EAGLE3_ARCH} reads one 2H-input layer")
    state = _state(ckpt)
    out = {("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k: v
           for k, v in state.items() if k != "draft_vocab"}
    conf_cfg = copy.deepcopy(cfg)
    for key in (*_DROP_KEYS, "target_layer_ids", "ttt_length", "step_loss_decay", "draft_num_hidden_layers"):
        conf_cfg.pop(key, None)
    conf_cfg.update({
        "architectures": [EAGLE3_ARCH], "model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False,
        "draft_vocab_size": spec.vocab_size, "target_hidden_size": spec.hidden_size,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    })
    notes: list[str] = []
    vocab = state.get("draft_vocab")
    if vocab is not None:
        _vllm_draft_vocab(out, conf_cfg, notes, state, vocab.long(), target_folder, engine, ckpt)
        if "embed_tokens.weight" not in out:
            out["embed_tokens.weight"] = _target_tensor(target_folder, "model.embed_tokens.weight", engine, ckpt)
    # the engines capture "the input of layer i": SGLang adds 1 to eagle_config's ids itself, vLLM reads them as is
    if engine == "sglang":
        conf_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    else:
        conf_cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    block = int(cfg.get("block_size", cfg.get("ttt_length", 7)))
    return ExportPlan(engine, "eagle3", conf_cfg, _bf16(out), block, notes=notes)


def _add_side_files(plan: ExportPlan, ckpt: Path, sps_table: str | Path | None, sts: str | Path | None) -> None:
    from dspark.scheduler.sps import SPSTable
    from dspark.scheduler.sts import load_sts_json

    if not sps_table and not sts:
        return
    if plan.engine == "vllm":
        raise _refuse(plan.engine, ckpt, "vLLM reads no SPS table or STS file (its adaptive verification profiles "
                      "and calibrates online): drop --sps-table/--sts")
    if plan.kind != "dspark" or not plan.has_confidence:
        raise _refuse(plan.engine, ckpt, "the SPS table and STS file feed SGLang's confidence-driven verify "
                      "scheduler, and this drafter has no confidence head")
    if sts and not sps_table:
        raise _refuse(plan.engine, ckpt, "SGLang's confidence-driven verify modes require an SPS table: "
                      "add --sps-table (dspark profile)")
    SPSTable.load(sps_table)  # BadFileError, one line, for a malformed table
    plan.side_files[SPS_FILE] = Path(sps_table)
    if sts:
        load_sts_json(sts, plan.block_size)  # exactly gamma positive temperatures
        plan.side_files[STS_FILE] = Path(sts)


def launch_command(plan: ExportPlan, out: Path, target: str) -> str:
    """The exact command that serves ``target`` with the exported drafter in ``out`` (absolute: the command
    works from any directory)."""
    out, G = str(Path(out).resolve()), plan.block_size
    if plan.engine == "sglang":
        algo = "DSPARK" if plan.kind == "dspark" else "EAGLE3"
        env = "SGLANG_RAGGED_VERIFY_MODE=compact " if SPS_FILE in plan.side_files else ""
        cmd = ["python", "-m", "sglang.launch_server", "--model-path", target,
               "--speculative-algorithm", algo, "--speculative-draft-model-path", out,
               "--speculative-num-draft-tokens", str(G + 1)]
        if plan.kind == "eagle3":
            cmd += ["--speculative-num-steps", str(G), "--speculative-eagle-topk", "1"]
        if SPS_FILE in plan.side_files:
            cmd += ["--speculative-dspark-sps-table-path", f"{out}/{SPS_FILE}"]
        if STS_FILE in plan.side_files:
            cmd += ["--speculative-dspark-confidence-sts-path", f"{out}/{STS_FILE}"]
        return env + " ".join(shlex.quote(c) for c in cmd)
    spec_cfg: dict[str, Any] = {"method": plan.kind, "model": out, "num_speculative_tokens": G,
                                "draft_sample_method": "probabilistic"}
    if plan.kind == "dspark" and plan.has_confidence:
        spec_cfg["enable_adaptive_verification"] = True
    # the module form: vLLM's CPU build has no working `vllm` console script (docs/interop.md §vLLM)
    return (f"python -m vllm.entrypoints.openai.api_server --model {shlex.quote(target)} "
            f"--speculative-config {shlex.quote(json.dumps(spec_cfg))}")


def export_for_engine(ckpt: str | Path, engine: str, out: str | Path, *, target: str = "TARGET",
                      sps_table: str | Path | None = None, sts: str | Path | None = None,
                      target_folder: str | Path | None = None) -> tuple[ExportPlan, str]:
    """Write ``out`` (config.json, model.safetensors in bf16, side files) and return the plan and launch command."""
    from safetensors.torch import save_file

    plan = plan_export(ckpt, engine, sps_table, sts, target_folder)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(plan.tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(plan.config, indent=2, sort_keys=True) + "\n")
    for name, src in plan.side_files.items():
        shutil.copyfile(src, out / name)
    return plan, launch_command(plan, out, target)

