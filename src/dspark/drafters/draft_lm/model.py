"""A distilled independent draft LM: a layer-pruned copy of the target, trained by KL(target || draft).

The classic speculative-decoding baseline (an independent small causal LM sharing
the target's tokenizer), built so that it needs no other model: take the target's
embedding, ``num_layers`` of its decoder layers (the first ones, or the ones
``layer_ids`` lists), its final norm and its LM head, and distil the target into
it on the regenerated training data. The teacher distribution of token t+1 is
``softmax(lm_head(target_last_hidden[t]))`` (DESIGN.md §1.4: d numbers per token
are cached or sent, never V), so the trainer's samples serve unchanged.

Loss, per sequence: mean over supervised positions t (the next token t+1 is an
assistant token, ``loss_mask[t+1] = 1``) of

    KL(target_probs_t || draft_probs_t) = sum_v target_probs log(target_probs / draft_probs)

plus ``ce_loss_alpha`` times the hard-label cross-entropy (0 by default). V-sized
tensors exist only for ``ROW_CHUNK`` rows at a time, recomputed in backward.

The checkpoint is an ordinary Hugging Face causal-LM folder: ``config.json`` is the
target's with ``num_hidden_layers`` = the draft's (and ``layer_types`` of the kept
layers), ``model.safetensors`` uses HF names (``model.embed_tokens.weight``,
``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight``), and the target's
tokenizer files are copied in. So ``dspark.drafters.draft_lm.drafter.load_draft_model``
(and ``--drafter FOLDER``) and transformers' ``AutoModelForCausalLM.from_pretrained``
(HF assisted generation) both load it.

Shapes: L = sequence length, M = supervised positions, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dspark.drafters.checkpoint import target_base_config, write_checkpoint
from dspark.errors import IncompatibleModelsError, ModelLoadError
from dspark.modeling.decoder import CausalLM
from dspark.modeling.spec import DecoderSpec, spec_from_config
from dspark.modeling.weights import load_into, load_state_dict, read_config
from dspark.drafters.losses import ROW_CHUNK
from dspark.drafters.sample import TrainSample

#: config.json key holding the draft-LM settings (an extra key transformers keeps and ignores)
CONFIG_KEY = "dspark_draft_lm"
#: files copied from the target folder so the draft carries the target's tokenizer and stop tokens
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
# families whose HF config reads ``layer_types`` (the others have no per-layer attention kinds)
_LAYER_TYPED = ("qwen2", "qwen3", "gemma2", "gemma3_text")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM"}


@dataclass
class DraftLMConfig:
    """Settings of the distilled draft LM (``--set model.num_layers=4`` etc.)."""

    num_layers: int = 4  # draft decoder layers; the first num_layers target layers unless layer_ids is set
    layer_ids: list[int] | None = None  # target layers to copy, in order (overrides num_layers)
    freeze_embeddings: bool = True  # keep embed_tokens and lm_head frozen (the target's)
    ce_loss_alpha: float = 0.0  # weight of the hard-label cross-entropy added to the KL
    # draft tokens per step (gamma) when decoding with it, as for the other drafters; recorded in config.json
    # (dspark_draft_lm.block_size) for `dspark bench speed`; `--block-size` overrides it elsewhere
    block_size: int = 7

    def __post_init__(self) -> None:
        if self.layer_ids is not None:
            self.layer_ids = [int(i) for i in self.layer_ids]
            if not self.layer_ids:
                raise ValueError("layer_ids must not be empty (or leave it null to copy the first num_layers)")
            if any(i < 0 for i in self.layer_ids) or len(set(self.layer_ids)) != len(self.layer_ids):
                raise ValueError(f"layer_ids must be distinct target layer indices >= 0, got {self.layer_ids}")
            self.num_layers = len(self.layer_ids)
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.ce_loss_alpha < 0:
            raise ValueError(f"ce_loss_alpha must be >= 0, got {self.ce_loss_alpha}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def source_layers(self, num_target_layers: int) -> list[int]:
        """The target layers the draft copies, checked against the target's depth."""
        ids = self.layer_ids if self.layer_ids is not None else list(range(self.num_layers))
        if max(ids) >= num_target_layers:
            raise ValueError(
                f"the draft LM needs target layers {ids} but the target has {num_target_layers}; "
                "lower model.num_layers or fix model.layer_ids"
            )
        return ids

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def draft_lm_spec(target_spec: DecoderSpec, layer_ids: list[int]) -> DecoderSpec:
    """The target's architecture with only ``layer_ids`` (their attention kinds kept)."""
    return dataclasses.replace(
        target_spec, num_layers=len(layer_ids), layer_types=[target_spec.layer_types[i] for i in layer_ids],
        rope=dict(target_spec.rope),
    )


def kl_row_terms(
    draft_logits: torch.Tensor,  # (m, V)
    target_logits: torch.Tensor,  # (m, V) no grad needed
    labels: torch.Tensor,  # (m,) int64 next tokens
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # kl (m,), ce (m,), soft acceptance (m,) (no grad)
    """KL(target_probs || draft_probs), hard-label CE and sum_v min(draft_probs, target_probs), at T = 1."""
    draft_logp = torch.log_softmax(draft_logits.float(), dim=-1)  # (m, V)
    target_logp = torch.log_softmax(target_logits.float(), dim=-1).detach()
    target_probs = target_logp.exp()
    kl = (target_probs * (target_logp - draft_logp)).sum(-1)
    ce = -draft_logp.gather(-1, labels[:, None]).squeeze(-1)
    with torch.no_grad():
        acc = torch.minimum(draft_logp.exp(), target_probs).sum(-1)
    return kl, ce, acc


class DraftLMModel(nn.Module):
    """A ``CausalLM`` (HF parameter names) plus how it was cut from the target and how it trains."""

    def __init__(self, config: DraftLMConfig, spec: DecoderSpec, base_config: dict[str, Any],
                 source_layer_ids: list[int], tokenizer_source=None) -> None:
        super().__init__()
        self.config = config
        self.spec = spec
        self.base_config = base_config
        self.source_layer_ids = list(source_layer_ids)
        self.lm = CausalLM(spec)  # model.embed_tokens / model.layers.{i} / model.norm / lm_head
        # the target's tokenizer files (a folder) or tokenizer object, copied into every checkpoint
        self.tokenizer_source = tokenizer_source
        # the teacher's LM head (V, H) when the draft's own head trains; None: the frozen head is the teacher's.
        # A buffer so it follows .to(device), but not saved: the checkpoint is the draft alone.
        self.register_buffer("teacher_head", None, persistent=False)

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_target(cls, target, cfg: DraftLMConfig, generator: torch.Generator | None = None) -> "DraftLMModel":
        """Copy embedding, the chosen decoder layers, final norm and LM head from ``target``."""
        ids = cfg.source_layers(target.num_layers)
        base = target_base_config(target)
        model = cls(cfg, draft_lm_spec(target.spec, ids), base, ids, _tokenizer_source(target))
        own = {f"model.layers.{i}.": f"model.layers.{src}." for i, src in enumerate(ids)}
        source = target.model.state_dict()
        state = {}
        for key in model.lm.state_dict():
            src = key
            for prefix, src_prefix in own.items():
                if key.startswith(prefix):
                    src = src_prefix + key[len(prefix):]
                    break
            state[key] = source[src].detach().float()
        load_into(model.lm, state, "draft LM (from the target)")
        if not cfg.freeze_embeddings:
            model.teacher_head = target.model.lm_head.weight.detach().float().clone()  # (V, H)
        model._apply_freeze()
        return model.to(target.dtype)

    @classmethod
    def from_checkpoint(cls, folder: Path, target=None) -> "DraftLMModel":
        """Load a draft-LM folder (any HF causal-LM folder works; settings default then) in float32."""
        folder = Path(folder)
        cfg_dict = read_config(folder)
        spec = spec_from_config(cfg_dict)
        saved = dict(cfg_dict.get(CONFIG_KEY) or {})
        source_ids = [int(i) for i in saved.pop("source_layer_ids", range(spec.num_layers))]
        saved.pop("num_target_layers", None)
        try:
            config = DraftLMConfig(**{**saved, "layer_ids": source_ids})
        except (TypeError, ValueError) as err:
            raise ModelLoadError(f"{folder}/config.json: invalid {CONFIG_KEY} settings ({err})") from None
        if target is not None and (spec.vocab_size != target.vocab_size or spec.hidden_size != target.hidden_size):
            raise IncompatibleModelsError(
                f"draft LM {folder} (vocabulary {spec.vocab_size}, hidden {spec.hidden_size}) does not fit the "
                f"target (vocabulary {target.vocab_size}, hidden {target.hidden_size}); distil one from this target"
            )
        base = {k: v for k, v in cfg_dict.items() if k not in (CONFIG_KEY, "torch_dtype", "dtype")}
        base["num_hidden_layers"] = _target_layers(cfg_dict, spec)
        model = cls(config, spec, base, source_ids, folder)
        state = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v.float()
                 for k, v in load_state_dict(folder).items()}
        if spec.tie_word_embeddings or "lm_head.weight" not in state:
            state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
        load_into(model.lm, state, f"draft LM {folder}")
        if not config.freeze_embeddings and target is not None:
            model.teacher_head = target.model.lm_head.weight.detach().float().clone()
        model._apply_freeze()
        return model.float()

    def _apply_freeze(self) -> None:
        frozen = self.config.freeze_embeddings
        self.lm.model.embed_tokens.requires_grad_(not frozen)
        self.lm.lm_head.requires_grad_(not frozen)

    # ----------------------------------------------------------------- what the trainer asks

    @property
    def target_layer_ids(self) -> list[int]:
        """Target features the trainer computes for this drafter: none (only the final hidden state)."""
        return []

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Decoder layers and final norm; embed_tokens and lm_head too unless ``freeze_embeddings``."""
        return [p for p in self.lm.parameters() if p.requires_grad]

    def _teacher_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:  # (m, H) -> (m, V)
        if self.teacher_head is None:
            return self.lm.logits(target_hidden.to(self.lm.lm_head.weight.dtype))
        out = target_hidden.float() @ self.teacher_head.float().t()
        if self.spec.final_softcap:
            out = torch.tanh(out / self.spec.final_softcap) * self.spec.final_softcap
        return out

    def training_loss(self, sample: TrainSample, generator: torch.Generator | None = None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
        """KL(target || draft) on assistant next tokens (+ ce_loss_alpha * CE), and metrics."""
        del generator  # no sampling in this loss
        ids = sample.input_ids
        L = ids.shape[0]
        rows = (sample.loss_mask[1:] > 0).nonzero().squeeze(-1)  # (M,) positions t whose next token is supervised
        metrics: dict[str, float] = {"supervised_tokens": float(rows.numel())}
        if rows.numel() == 0:  # keep every trainable parameter in the graph (DDP buckets)
            zero = sum((p.sum() * 0.0 for p in self.trainable_parameters()), torch.zeros((), device=ids.device))
            return zero, {**metrics, "loss": 0.0}
        hidden, _ = self.lm.model(ids, [L], None)  # (L, H) final-normed, causal
        hidden = hidden[rows]  # (M, H)
        target_hidden = sample.target_last_hidden[rows]  # (M, H)
        labels = ids[rows + 1]  # (M,)

        def one(h, t_hidden, lab):
            with torch.no_grad():
                target_logits = self._teacher_logits(t_hidden)
            return kl_row_terms(self.lm.logits(h), target_logits, lab)

        use_ckpt = torch.is_grad_enabled()
        parts = []
        for s in range(0, rows.numel(), ROW_CHUNK):
            args = (hidden[s : s + ROW_CHUNK], target_hidden[s : s + ROW_CHUNK], labels[s : s + ROW_CHUNK])
            parts.append(checkpoint(one, *args, use_reentrant=False) if use_ckpt else one(*args))
        kl, ce, acc = (torch.cat(x) for x in zip(*parts))
        loss = kl.mean()
        if self.config.ce_loss_alpha > 0:
            loss = loss + self.config.ce_loss_alpha * ce.mean()
        metrics.update(loss=float(loss.detach()), kl=float(kl.detach().mean()), ce=float(ce.detach().mean()),
                       acc=float(acc.mean()))  # acc: expected acceptance of one draft token, sum_v min(p_d, p_t)
        return loss, metrics

    def forward(self, sample: TrainSample, generator: torch.Generator | None = None):
        return self.training_loss(sample, generator)

    # ----------------------------------------------------------------- checkpoint

    def hf_config(self) -> dict[str, Any]:
        """The target's config.json with the draft's depth; our settings under ``dspark_draft_lm``."""
        out = copy.deepcopy(self.base_config)
        num_target_layers = int(out.get("num_hidden_layers", max(self.source_layer_ids) + 1))
        n = self.spec.num_layers
        out["architectures"] = list(out.get("architectures") or [_ARCHITECTURES[self.spec.model_type]])
        out["model_type"] = out.get("model_type", self.spec.model_type)
        out["num_hidden_layers"] = n
        if self.spec.model_type in _LAYER_TYPED:
            out["layer_types"] = list(self.spec.layer_types)
            out.pop("max_window_layers", None)  # layer_types says which layers slide
        out[CONFIG_KEY] = {
            "source_layer_ids": list(self.source_layer_ids), "num_target_layers": num_target_layers,
            "freeze_embeddings": self.config.freeze_embeddings, "ce_loss_alpha": self.config.ce_loss_alpha,
            "block_size": self.config.block_size,
        }
        return out

    def save_checkpoint(self, folder: Path, dtype: torch.dtype = torch.float32) -> None:
        """An HF causal-LM folder: config.json, model.safetensors (HF names), the target's tokenizer files."""
        folder = Path(folder)
        write_checkpoint(folder, self.lm.state_dict(), self.hf_config(), dtype)
        _copy_tokenizer(self.tokenizer_source, folder)


def _target_layers(cfg_dict: dict[str, Any], spec: DecoderSpec) -> int:
    saved = cfg_dict.get(CONFIG_KEY) or {}
    return int(saved.get("num_target_layers", spec.num_layers))


def _tokenizer_source(target):
    """Where the target's tokenizer comes from: its folder if it has tokenizer files, else the object."""
    path = getattr(target, "path", None)
    if path is not None and any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return Path(path)
    return getattr(target, "tokenizer", None)


def _copy_tokenizer(source, folder: Path) -> None:
    if source is None:
        return
    if isinstance(source, Path):
        if source.resolve() == folder.resolve():
            return
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)
    else:
        source.save_pretrained(str(folder))


def saved_block_size(folder: str | Path) -> int | None:
    """The block size a draft-LM folder was trained for (``dspark_draft_lm.block_size``), else None."""
    try:
        saved = read_config(Path(folder)).get(CONFIG_KEY) or {}
    except ModelLoadError:
        return None
    value = saved.get("block_size")
    return int(value) if value else None
