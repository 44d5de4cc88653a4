"""The frozen target model: logits, chosen hidden states, final hidden state, KV caches.

Loading never runs code from a model folder: the architecture is our own
(``dspark.modeling``), weights come from safetensors, the tokenizer is loaded
with ``trust_remote_code=False``.

Shapes: N = tokens in a flattened batch, M = tokens whose logits are asked
for, H = hidden size, V = vocabulary, F = len(layer ids) * H.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.errors import ModelLoadError, PromptError
from dspark.modeling.decoder import CausalLM
from dspark.modeling.kv_cache import KVCache
from dspark.modeling.layers import fuse_projections
from dspark.modeling.packed import pack_linears
from dspark.modeling.spec import DecoderSpec, spec_from_config
from dspark.modeling.weights import load_into, load_state_dict, read_config
from dspark.target.convert import resolve_model_path


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # (M, V) at the positions asked for
    last_hidden: torch.Tensor  # (N, H) final-normed (pre-LM-head) state
    features: torch.Tensor | None  # (N, F) outputs of target_layer_ids, concatenated in id order


def default_target_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """``count`` layers spread evenly from layer 1 to L-3 (docs/conventions.md §Context features)."""
    if num_layers < 4:
        return list(range(num_layers))[:count]
    last = num_layers - 3
    return sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)})


def chat_template_kwargs(tokenizer) -> dict:
    """`enable_thinking=False` for templates that read it (Qwen3), nothing otherwise: the evaluation protocol's
    and the training data's prompts (docs/interop.md §Evaluation protocol)."""
    template = tokenizer.chat_template or ""
    if not isinstance(template, str):  # several named templates
        template = " ".join(str(t) for t in (template.values() if isinstance(template, dict) else template))
    return {"enable_thinking": False} if "enable_thinking" in template else {}


class TargetModel:
    def __init__(self, model: CausalLM, tokenizer, name: str, path: Path | None,
                 eos_token_ids: list[int], max_context: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.batch_invariant: bool | None = None  # None: not asked for; else what make_batch_invariant found

    @property
    def spec(self) -> DecoderSpec:
        return self.model.spec

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype; drafters loaded for this target are cast to it."""
        return self.model.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per position of one request, from the model config and dtype (``DecoderSpec``)."""
        return self.spec.kv_bytes_per_token(self.model.lm_head.weight.dtype)

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def default_layer_ids(self, count: int = 5) -> list[int]:
        return default_target_layer_ids(self.num_layers, count)

    def new_cache(self, capacity: int = 256) -> KVCache:
        return self.model.new_cache(capacity, max_length=self.max_context)

    def reserve_cache(self, slots: int, capacity: int) -> int:
        """Size the KV pool for ``slots`` requests of ``capacity`` positions now; returns its bytes."""
        pool = self.model.reserve_kv(slots, capacity, max_length=self.max_context)
        return pool.num_slots * pool.capacity * pool.bytes_per_token

    def make_batch_invariant(self) -> bool:
        """Run lone rows as two (``Decoder.batch_invariant``) and return whether a one-token step and a verify
        block now compute every row bitwise alike on this model and backend (``batch_invariance_holds``)."""
        self.model.model.batch_invariant = True
        self.batch_invariant = self.batch_invariance_holds()
        return self.batch_invariant

    def batch_invariance_holds(self, rows: int = 8, prompt_len: int = 12) -> bool:
        """Whether ``rows`` one-token steps give bitwise the logits of one block of those ``rows`` tokens
        after the same prompt: what greedy speculative decoding needs to emit exactly the plain text."""
        return self.step_block_gap(rows, prompt_len) == 0.0

    @torch.inference_mode()
    def step_block_gap(self, rows: int = 8, prompt_len: int = 12) -> float:
        """The largest absolute logit difference between ``rows`` one-token steps and one block of the same
        ``rows`` tokens, after the same random prompt (0.0 = batch-invariant)."""
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (prompt_len + rows,), generator=gen)  # (P + rows,)
        prompt, tail = ids[:prompt_len], ids[prompt_len:]
        one, block = self.new_cache(prompt_len + rows), self.new_cache(prompt_len + rows)
        for cache in (one, block):
            self.forward(prompt, [prompt_len], [cache], logits_for="none")
        single = torch.cat([self.forward(tail[i : i + 1], [1], [one]).logits for i in range(rows)])  # (rows, V)
        return (single.float() - self.forward(tail, [rows], [block]).logits.float()).abs().max().item()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) int64, requests concatenated
        seq_lens: list[int],
        caches: list[KVCache] | None,
        capture_layers: list[int] | None = None,
        # "all" | "last" (last token of each request) | "none" | (M,) int64 rows whose logits to compute
        logits_for: str | torch.Tensor = "all",
        prompt_from: int | None = None,  # requests from this index on are prompt pieces (Decoder.forward)
    ) -> TargetOutput:
        input_ids = input_ids.to(self.device, non_blocking=True)  # callers build ids on the host
        last_hidden, features = self.model.model(input_ids, seq_lens, caches, capture_layers, prompt_from)
        if isinstance(logits_for, torch.Tensor):
            logits = self.model.logits(last_hidden[logits_for.to(last_hidden.device)])
        elif logits_for == "all":
            logits = self.model.logits(last_hidden)
        elif logits_for == "last":
            ends = torch.tensor(seq_lens, device=last_hidden.device).cumsum(0) - 1  # (R,)
            logits = self.model.logits(last_hidden[ends])
        else:
            logits = None
        return TargetOutput(logits=logits, last_hidden=last_hidden, features=features)

    def encode_chat(self, user_message: str) -> list[int]:
        """First-turn prompt: one user message through the chat template (docs/interop.md §Evaluation protocol)."""
        if not user_message or not user_message.strip():
            raise PromptError("the prompt is empty")
        tok = self.tokenizer
        if tok.chat_template:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=True,
                **chat_template_kwargs(tok),
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return tok.encode(user_message, add_special_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        if not text:
            raise PromptError("the prompt is empty")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int = 0) -> None:
        """Raise PromptError unless the prompt and ``max_new_tokens`` new tokens fit into the context."""
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {self.max_context}; shorten it"
            )
        if len(prompt_ids) + max_new_tokens > self.max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens and {max_new_tokens} new tokens were asked for, "
                f"but the model's context is {self.max_context}; ask for at most "
                f"{self.max_context - len(prompt_ids)} new tokens or shorten the prompt"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")


def _eos_ids(folder: Path, cfg: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = folder / "generation_config.json"
    sources = [json.loads(gen.read_text())] if gen.is_file() else []
    sources.append(cfg)
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is not None:
            ids.extend(eos if isinstance(eos, list) else [eos])
            break
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


_DECODER_PREFIXES = ("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")


def build_model(spec: DecoderSpec, state: dict[str, torch.Tensor], what: str,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> CausalLM:
    model = CausalLM(spec)
    state = {k.removeprefix("model.language_model.").removeprefix("language_model."): v for k, v in state.items()}
    state = {(k if k.startswith(("model.", "lm_head.")) else f"model.{k}"): v for k, v in state.items()}
    if spec.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
        if state["lm_head.weight"] is None:
            raise ModelLoadError(f"{what}: no embed_tokens weight in the checkpoint")
        if not spec.tie_word_embeddings:  # untied model without lm_head: share explicitly
            model.lm_head.weight = model.model.embed_tokens.weight
    # A decoder tensor we would not use (a bias, an extra norm) means the architecture differs from
    # what the config made us build: refuse rather than run without it. Vision towers etc. may stay.
    own = model.state_dict()
    unused = [k for k in state if k.startswith(_DECODER_PREFIXES) and k not in own and not k.endswith("inv_freq")]
    if unused:
        raise ModelLoadError(
            f"{what}: the checkpoint has weights this architecture does not use: "
            f"{unused[:5]}{'...' if len(unused) > 5 else ''}; config.json does not describe these weights"
        )
    load_into(model, state, what)
    return model.to(dtype=dtype).to(device)  # cast on the host first: a GPU then receives the smaller copy


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as err:
        raise ModelLoadError(f"cannot load the tokenizer from {folder}: {err}") from None


def load_target(name_or_path: str, dtype: torch.dtype = torch.float32, tokenizer: bool = True,
                fuse: bool = False, device: torch.device | str = "cpu", batch_invariant: bool = False,
                pack: bool = True) -> TargetModel:
    """Load a preset (e.g. ``smollm2-135m``) or a local HF causal-LM folder onto ``device``.

    ``device`` is a torch device (``dspark.target.loading.resolve_device`` turns ``--device`` into one); the
    KV caches (``new_cache``) and the drafters loaded for this target follow it.

    ``fuse``: the decoding layout: q/k/v and gate/up as one matmul each and, on the CPU, every weight prepacked
    for oneDNN (``dspark.modeling.packed``); the target's state_dict then loses its checkpoint names, so not for
    code that copies target weights by name, like the draft-LM initialiser. ``pack=False`` keeps plain
    ``nn.Linear``s (``torch.compile`` cannot lower the packed ops; ``--compile`` loads unpacked).

    ``batch_invariant`` (decoding): in bfloat16 on the CPU, compute a one-token step as a verify block computes
    its rows (``TargetModel.make_batch_invariant``), so greedy speculative decoding emits exactly plain
    decoding's text; a warning where this backend still rounds them differently. Ignored elsewhere: float32
    logits differ slightly between the two shapes (``step_block_gap``, docs/reports/performance-packing.md; a greedy flip
    needs a tie that close), GPUs need other kernels.
    """
    folder = resolve_model_path(name_or_path)
    cfg = read_config(folder)
    spec = spec_from_config(cfg)
    model = build_model(spec, load_state_dict(folder), f"target {name_or_path}", dtype, device)
    if fuse:
        fuse_projections(model.model.layers)
        if pack:  # CPU: weights reordered once for oneDNN (modeling/packed.py); elsewhere a no-op
            pack_linears(model)
            if model.lm_head.weight.device.type == "cpu":  # bf16 rows through fused C kernels (modeling/cpu_kernels.py)
                model.model.use_cpu_kernels()
    tok = load_tokenizer(folder) if tokenizer else None
    if tok is not None and len(tok) > spec.vocab_size:
        raise ModelLoadError(f"tokenizer has {len(tok)} tokens but the model's vocabulary is {spec.vocab_size}")
    target = TargetModel(model, tok, name_or_path, folder, _eos_ids(folder, cfg, tok), spec.max_position_embeddings)
    if batch_invariant and dtype == torch.bfloat16 and target.device.type == "cpu" and not target.make_batch_invariant():
        print("[dspark] warning: on this CPU a bfloat16 one-token step and a verify block round differently even "
              "with lone rows run as two, so greedy speculative text can leave plain decoding's at a near-tie "
              "(still the bf16 target's distribution); --dtype float32 avoids it", file=sys.stderr)
    return target


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX tiles): there bf16 decoding beats
    float32 (docs/reports/performance.md) and ``make_batch_invariant`` is what makes it exact."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
