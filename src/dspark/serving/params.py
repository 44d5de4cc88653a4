"""From an OpenAI request to the engine's ``SamplingParams``: defaults, ranges, the context budget.

A field the request omits takes the model folder's ``generation_config.json`` value (temperature,
top_p, top_k), else OpenAI's (temperature 1, top_p 1, no top-k), as vLLM's ``--generation-config auto``
does. ``max_tokens`` defaults to the room left in the context, capped by ``--default-max-tokens`` when
given (else by generation_config's ``max_new_tokens`` when it has one).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import DSparkError
from dspark.sampling.processing import SamplingParams
from dspark.serving.protocol import APIError, SamplingFields, check_text

log = logging.getLogger("dspark.serving")

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM has no cap
MAX_STOP_CHARS = 2048  # per stop string: its matcher's table is built on the event loop
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids entries: the engine checks each committed token against them
# generation_config.json keys vLLM reads as sampling defaults that this server cannot apply
_UNAPPLIED = {"repetition_penalty": 1.0, "min_p": 0.0}


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the sampling fields a request omits."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int | None = None  # generation_config's max_new_tokens: a cap on the default max_tokens

    @classmethod
    def from_folder(cls, folder: str | Path | None) -> "SamplingDefaults":
        """The defaults of ``folder/generation_config.json``; OpenAI's where it has none (or no file)."""
        path = Path(folder) / "generation_config.json" if folder is not None else None
        if path is None or not path.is_file():
            return cls()
        try:
            gen = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise DSparkError(f"cannot read {path}: {err}") from None
        for key, neutral in _UNAPPLIED.items():
            if gen.get(key) not in (None, neutral):
                log.warning("%s sets %s=%s, which this server does not implement; it is not applied",
                            path, key, gen[key])
        top_k = gen.get("top_k")
        return cls(temperature=float(gen.get("temperature", 1.0)), top_p=float(gen.get("top_p", 1.0)),
                   top_k=0 if top_k in (None, -1) else int(top_k), max_tokens=gen.get("max_new_tokens"))


@dataclass(frozen=True)
class ContextBudget:
    """What one request may use: the model's context, the prompt limit and the default-max-tokens cap."""

    max_context: int
    max_prompt: int
    vocab_size: int
    default_max_tokens: int | None = None  # None: the room left in the context


def sampling_params(req: SamplingFields, prompt_len: int, max_tokens: int | None, defaults: SamplingDefaults,
                    budget: ContextBudget) -> SamplingParams:
    """The engine's parameters for ``req``, or APIError 400 naming the field that is out of range."""
    if req.n not in (None, 1):
        raise APIError(400, "only n=1 is supported; send several requests instead", param="n")
    temperature = defaults.temperature if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise APIError(400, f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {temperature}",
                       param="temperature")
    top_p = defaults.top_p if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = defaults.top_k if req.top_k is None else (0 if req.top_k == -1 else req.top_k)
    if top_k < 0:
        raise APIError(400, f"top_k must be >= 0 (or -1 for off), got {req.top_k}", param="top_k")
    max_context, max_prompt = budget.max_context, budget.max_prompt
    if prompt_len > max_prompt and max_prompt < max_context:
        raise APIError(400, f"the prompt has {prompt_len} tokens but this server accepts at most {max_prompt}",
                       param="prompt", code="prompt_too_long")
    if prompt_len >= max_context:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the model's context is {max_context} tokens; "
                       "shorten the prompt", param="prompt", code="context_length_exceeded")
    room = max_context - prompt_len
    if max_tokens is None:
        cap = budget.default_max_tokens if budget.default_max_tokens is not None else defaults.max_tokens
        max_tokens = room if cap is None else min(cap, room)
    elif max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    elif max_tokens > room:
        raise APIError(400, f"the model's context is {max_context} tokens: the prompt has {prompt_len}, so "
                       f"max_tokens can be at most {room} (got {max_tokens})", param="max_tokens",
                       code="context_length_exceeded")
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported, got {len(stop_ids)}",
                       param="stop_token_ids")
    bad = [t for t in stop_ids if not 0 <= t < budget.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids {bad[:5]} are outside the vocabulary", param="stop_token_ids")
    seed = None if req.seed is None else req.seed % (2**63)
    return SamplingParams(temperature, top_k, top_p, max_tokens, seed, stop_ids)


def stop_strings(req: SamplingFields) -> list[str]:
    """The request's stop strings, or 400 naming the limit they break (count, then length, then Unicode)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}",
                       param="stop", code="too_many_stop_strings")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"stop[{i}] has {len(s)} characters; a stop string may have at most "
                           f"{MAX_STOP_CHARS}", param=f"stop[{i}]" if isinstance(req.stop, list) else "stop",
                           code="stop_string_too_long")
    check_text(stops, "stop")
    return stops


def truncate_prompt(req: SamplingFields, prompt_ids: list[int]) -> list[int]:
    """``truncate_prompt_tokens``: keep the last N prompt tokens (vLLM's extension)."""
    n = req.truncate_prompt_tokens
    if n is None:
        return prompt_ids
    if n < 1:
        raise APIError(400, f"truncate_prompt_tokens must be >= 1, got {n}", param="truncate_prompt_tokens")
    return prompt_ids[-n:]
