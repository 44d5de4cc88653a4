"""The Python API: what `dspark generate`, `dspark serve` and `dspark train` do, from Python, with their defaults.

    import dspark
    sd = dspark.load("smollm2-135m", drafter="checkpoints/smollm2-135m-dspark")  # a preset or an HF folder
    out = sd.chat("Write a prime sieve in Python.", max_new_tokens=128)
    print(out.text, out.acceptance_length)

``load`` reads the target the way every decoding command does (``dspark.target.loading.load_decoding_target``:
the fused, prepacked layout, batch-invariant one-token steps, bfloat16 on a GPU and float32 on a CPU) and the
drafter the way ``--drafter`` names it (``dspark.drafters.registry.load_drafter``). ``generate`` decodes a static
batch (``dspark.generation.generator.SpeculativeGenerator``); ``stream`` / ``stream_chat`` and ``engine`` go
through the continuous-batching engine the server runs (``dspark.serving.engine.Engine``); ``train`` is
`dspark train --config ...`. Greedy output (temperature 0, the default here as in `dspark generate`) is exactly the
target's own greedy output; sampled output follows the target's distribution. docs/guide/python-api.md has the
examples, run by tests/test_docs_examples.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.drafters.options import DraftingOptions
from dspark.errors import DSparkError, PromptError
from dspark.generation.stats import AcceptanceStats
from dspark.sampling.processing import SamplingParams
from dspark.target.loading import load_decoding_target
from dspark.target.presets import DEFAULT_TARGET

Messages = Sequence[dict[str, str]]  # [{"role": "user", "content": "..."}, ...]


@dataclass(frozen=True)
class Completion:
    """One request's output: ``text`` (special tokens removed), ``token_ids`` (the generated ids, a stop token
    included when one ended the request), ``finish_reason`` ("stop" or "length") and the acceptance statistics:
    ``acceptance_length`` is tau, the mean tokens committed per verify step, bonus included (1.0 = no gain)."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: AcceptanceStats

    @property
    def acceptance_length(self) -> float:
        return self.stats.acceptance_length


class TextStream:
    """Text pieces as the engine commits tokens (``for piece in stream``); ``completion`` once it is exhausted.

    Leaving the loop early cancels the request (``close``)."""

    def __init__(self, decoder: "SpeculativeDecoder", prompt_ids: list[int], sampling: SamplingParams) -> None:
        self._decoder, self._prompt_ids, self._sampling = decoder, prompt_ids, sampling
        self.completion: Completion | None = None
        self._pieces = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self) -> None:
        self._pieces.close()

    def _run(self) -> Iterator[str]:
        from dspark.serving.engine import Engine, EngineConfig
        from dspark.serving.text import IncrementalDecoder

        target = self._decoder.target
        text = IncrementalDecoder(target.tokenizer)
        ids: list[int] = []
        pieces: list[str] = []
        with Engine(target, self._decoder.drafter, None, EngineConfig(max_batch=1, max_queue=0)) as engine:
            handle = engine.submit(self._prompt_ids, self._sampling)
            try:
                for event in handle.events():
                    if event.finish_reason == "error":
                        raise DSparkError(f"the engine failed on this request: {event.error}")
                    ids += event.token_ids
                    piece = "".join(text.step(t) for t in event.token_ids)
                    if event.finished:
                        piece += text.flush()
                    if piece:
                        pieces.append(piece)
                        yield piece
                    if event.finished:
                        self.completion = Completion("".join(pieces), ids, self._prompt_ids, event.finish_reason,
                                                     handle.stats or AcceptanceStats(block_size=max(self._decoder.drafter.block_size, 1)))
            finally:
                handle.cancel()


class SpeculativeDecoder:
    """A target and a drafter, loaded once (``dspark.load``); decode with ``generate``, ``chat``, ``stream``."""

    def __init__(self, target, drafter, drafter_name: str) -> None:
        self.target = target  # dspark.target.model.TargetModel
        self.drafter = drafter  # dspark.drafters.base.Drafter
        self.drafter_name = drafter_name

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def __repr__(self) -> str:
        return (f"SpeculativeDecoder(target={self.target.name!r}, drafter={self.drafter_name!r}, "
                f"dtype={str(self.target.dtype).removeprefix('torch.')}, device={self.target.device.type})")

    # ------------------------------------------------------------ prompts
    def encode_chat(self, messages_or_text: str | Messages) -> list[int]:
        """A user message, or a whole conversation, through the target's chat template (generation prompt added)."""
        if isinstance(messages_or_text, str):
            return self.target.encode_chat(messages_or_text)
        messages = list(messages_or_text)
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in messages):
            raise PromptError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')
        tokenizer = self._need_tokenizer()
        if not tokenizer.chat_template:
            raise PromptError(f"{self.target.name} has no chat template; pass a string to generate() instead")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            self._need_tokenizer()
            return self.target.encode_text(prompt)
        return [int(t) for t in prompt]

    def _need_tokenizer(self):
        if self.target.tokenizer is None:
            raise PromptError(f"{self.target.name} was loaded without a tokenizer; pass token ids")
        return self.target.tokenizer

    def _text(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True) if self.target.tokenizer else ""

    # ------------------------------------------------------------ decoding
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list[Completion]:
        """Decode a batch of raw prompts (strings, no chat template, or token-id lists); one ``Completion`` each.

        One string or one id list is a batch of one. Request i is seeded with ``seed + i``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._generate([self._prompt_ids(p) for p in prompts], max_new_tokens, temperature, top_k, top_p, seed)

    def chat(self, messages_or_text: str | Messages, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Completion:
        """Answer a user message (or continue a conversation of role/content dicts) as the chat model."""
        ids = self.encode_chat(messages_or_text)
        return self._generate([ids], max_new_tokens, temperature, top_k, top_p, seed)[0]

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> TextStream:
        """Like ``generate`` for one raw prompt, but text pieces arrive as the tokens are committed."""
        self._need_tokenizer()
        return TextStream(self, self._prompt_ids(prompt), self._sampling(max_new_tokens, temperature, top_k, top_p,
                                                                         seed))

    def stream_chat(self, messages_or_text: str | Messages, max_new_tokens: int = 128, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> TextStream:
        """Like ``chat``, streamed."""
        self._need_tokenizer()
        return TextStream(self, self.encode_chat(messages_or_text),
                          self._sampling(max_new_tokens, temperature, top_k, top_p, seed))

    def engine(self, policy: str = "all", max_batch: int = 8, max_queue: int = 64, prefill_chunk: int | None = 256,
               sps_table: str | Path | None = None, sts: str | Path | None = None,
               fallback_confidence: float = 1.0):
        """The continuous-batching engine `dspark serve` runs, with the same verify policy names
        (``dspark.scheduler.adapter.POLICY_HELP``) and defaults; token ids in and out. Use it as a context
        manager: ``with sd.engine() as engine: engine.generate(ids, SamplingParams(...))``. ``sps_table``: what
        ``alg1`` / ``async`` plan on, a step-cost model or an SPS table file (`dspark profile`)."""
        from dspark.generation.step_profile import load_or_profile_cost
        from dspark.scheduler.adapter import make_policy, parse_policy
        from dspark.scheduler.sts import load_sts_json
        from dspark.serving.engine import Engine, EngineConfig

        spec = parse_policy(policy)
        table = None
        if spec.needs_sps_table:
            table = load_or_profile_cost(str(sps_table) if sps_table else None, self.target, self.drafter, max_batch)
        temps = load_sts_json(str(sts), self.drafter.block_size) if sts else None
        return Engine(self.target, self.drafter, make_policy(policy, table, temps, fallback_confidence),
                      EngineConfig(max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk))

    def _sampling(self, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  seed: int) -> SamplingParams:
        try:
            return SamplingParams(temperature, top_k, top_p, max_new_tokens, seed)
        except ValueError as err:
            raise DSparkError(str(err)) from None

    def _generate(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, top_k: int,
                  top_p: float, seed: int) -> list[Completion]:
        from dspark.generation.generator import SpeculativeGenerator

        if not prompt_ids:
            return []
        sampling = [self._sampling(max_new_tokens, temperature, top_k, top_p, seed + i) for i in range(len(prompt_ids))]
        results = SpeculativeGenerator(self.target, self.drafter).generate(prompt_ids, sampling)
        return [Completion(self._text(r.output_ids), r.output_ids, r.prompt_ids, r.finish_reason, r.stats)
                for r in results]


def load(target: str = DEFAULT_TARGET, drafter: str | None = None, *, device: str = "auto", dtype: str | None = None,
         compile: bool = False, block_size: int | None = None, head_top_m: int | None = None,
         draft_vocab: str | Path | None = None, hybrid: bool = False, hybrid_min_ngram: int = 3) -> SpeculativeDecoder:
    """A target (preset name or local HF folder) and a drafter, loaded as `dspark generate` loads them.

    ``drafter``: None or "none" (plain decoding), "prompt-lookup", a DSpark/DFlash/Eagle3 checkpoint folder or an HF
    causal-LM folder (an independent draft model). The keywords are the decoding flags of the CLI, with the same
    defaults: ``device`` (auto = cuda when a GPU is available, else cpu), ``dtype`` (None = bfloat16 on cuda,
    float32 on cpu), ``compile``, ``block_size`` (None = the drafter's), ``head_top_m``, ``draft_vocab``,
    ``hybrid`` and ``hybrid_min_ngram`` (`dspark generate --help` says what each does)."""
    from dspark.drafters.registry import load_drafter

    loaded = load_decoding_target(str(target), device, dtype, compile)
    try:
        options = DraftingOptions(block_size, head_top_m, str(draft_vocab) if draft_vocab else None, hybrid,
                                  hybrid_min_ngram, dtype=str(loaded.dtype).removeprefix("torch."), compile=compile)
    except ValueError as err:
        raise DSparkError(str(err)) from None
    name = "none" if drafter is None else str(drafter)
    return SpeculativeDecoder(loaded, load_drafter(name, loaded, options), name)


def train(config: str | Path | dict[str, Any] | Any, *, overrides: Sequence[str] = (), resume: bool = False,
          overwrite: bool = False, **fields: Any) -> Path:
    """`dspark train`: train a drafter and return the folder of its last checkpoint.

    ``config``: a bundled preset name (``dspark.presets.preset_names()``), a JSON file, a dict of training-config
    fields or a ``TrainConfig``. ``overrides`` are `--set` strings ("lr=3e-4", "model.block_size=7"); ``fields``
    set top-level fields as the CLI flags do (``out=``, ``device=``, ``max_steps=``, ...)."""
    from dspark.presets import apply_overrides
    from dspark.training.config import TrainConfig, TrainConfigError, build_model_config, config_from_dict, load_config
    from dspark.training.trainer import train as run_training

    if isinstance(config, (TrainConfig, dict)):
        raw = config.to_dict() if isinstance(config, TrainConfig) else dict(config)
        raw = apply_overrides(raw, list(overrides), TrainConfigError)
        cfg = config_from_dict({**raw, **{k: v for k, v in fields.items() if v is not None}})
        build_model_config(cfg)  # the model sub-config's own checks, as load_config makes them
    else:
        cfg = load_config(str(config), list(overrides), **fields)
    return run_training(cfg, resume=resume, overwrite=overwrite)
