"""A distilled independent draft LM: a layer-pruned copy of the target, trained by KL(target || draft).

The classic speculative-decoding baseline (an independent small causal LM sharing
the target's tokenizer), built so that it needs no other model: take the target's
embedding, ``num_layers`` of its decoder layers (the first ones, or the ones
``layer_ids`` lists), its final norm and its LM head, and distil the target into
it on the regenerated training data. The teacher distribution of token t+1 is
``softmax(lm_head(target_last_hidden[t]))``: d numbers per token are cached or sent,
never V (docs/conventions.md §Target distribution in training), so the trainer's samples serve unchanged.

The loss, KL(target || draft) on assistant next tokens, is ``loss.py``'s.

The checkpoint is an ordinary Hugging Face causal-LM folder: ``config.json`` is the
target's with ``num_hidden_layers`` = the draft's (and ``layer_types`` of the kept
layers), ``model.safetensors`` uses HF names (``model.embed_tokens.weight``,
``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight``), and the target's
tokenizer files are copied in. So ``dspark.drafters.draft_lm.drafter.load_draft_model``
(and ``--drafter FOLDER``) and transformers' ``AutoModelForCausalLM.from_pretrained``
(HF assisted generation) both load it.

Shapes: L = sequence length, H = hidden size, V = vocabulary.
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

from dspark.drafters.checkpoint import target_base_config, write_checkpoint
from dspark.drafters.draft_lm.config import DraftLMConfig
from dspark.drafters.sample import TrainSample
from dspark.errors import IncompatibleModelsError, ModelLoadError
from dspark.modeling.decoder import CausalLM
from dspark.modeling.spec import DecoderSpec, spec_from_config
from dspark.modeling.weights import load_into, load_state_dict, read_config

#: config.json key holding the draft-LM settings (an extra key transformers keeps and ignores)
CONFIG_KEY = "dspark_draft_lm"
#: files copied from the target folder so the draft carries the target's tokenizer and stop tokens
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
# families whose HF config reads ``layer_types`` (the others have no per-layer attention kinds)
_LAYER_TYPED = ("qwen2", "qwen3", "gemma2", "gemma3_text")
#: the HF causal-LM architecture name a draft-LM checkpoint carries, by model type
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM"}


def draft_lm_spec(target_spec: DecoderSpec, layer_ids: list[int]) -> DecoderSpec:
    """The target's architecture with only ``layer_ids`` (their attention kinds kept)."""
    return dataclasses.replace(
        target_spec, num_layers=len(layer_ids), layer_types=[target_spec.layer_types[i] for i in layer_ids],
        rope=dict(target_spec.rope),
    )


@dataclass
class DraftLMOutputs:
    """The model's outputs on one sequence."""

    hidden: torch.Tensor  # (L, H) final-normed hidden states; lm.logits(hidden[t]) drafts token t+1


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
        return model.to(device=target.device, dtype=target.dtype)

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

    def teacher_logits(self, target_hidden: torch.Tensor) -> torch.Tensor:  # (m, H) -> (m, V)
        """The target's logits from its final-normed hidden state (the teacher of the distillation)."""
        if self.teacher_head is None:
            return self.lm.logits(target_hidden.to(self.lm.lm_head.weight.dtype))
        out = target_hidden.float() @ self.teacher_head.float().t()
        if self.spec.final_softcap:
            out = torch.tanh(out / self.spec.final_softcap) * self.spec.final_softcap
        return out

    def forward(self, sample: TrainSample, generator: torch.Generator | None = None) -> DraftLMOutputs:
        """The draft's causal hidden states over the sequence (the loss is ``DraftLMLoss``'s job)."""
        del generator  # no sampling here
        ids = sample.input_ids
        hidden, _ = self.lm.model(ids, [ids.shape[0]], None)  # (L, H) final-normed, causal
        return DraftLMOutputs(hidden)

    # ----------------------------------------------------------------- checkpoint

    def hf_config(self) -> dict[str, Any]:
        """The target's config.json with the draft's depth; our settings under ``dspark_draft_lm``."""
        out = copy.deepcopy(self.base_config)
        num_target_layers = int(out.get("num_hidden_layers", max(self.source_layer_ids) + 1))
        n = self.spec.num_layers
        out["architectures"] = list(out.get("architectures") or [HF_ARCHITECTURES[self.spec.model_type]])
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
