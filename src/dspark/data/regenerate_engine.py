"""Regeneration through the continuous-batching engine: a turn joins the batch as soon as a slot frees.

The static-batch path decodes ``batch_size`` conversations together and waits for the longest
answer before starting the next batch; here ``dspark.serving.engine.Engine`` keeps ``max_batch``
requests decoding, and each conversation submits its next turn the moment its last one ends.
Every turn samples from its own generator seeded by (seed, line, turn) with no drafter, so the
records are the ones the static path writes (the engine's per-request reproducibility,
src/dspark/serving/engine.py).
"""

from __future__ import annotations

import asyncio

from dspark.data.regenerate_io import CHAT_TEMPLATE_KWARGS, Reply
from dspark.errors import DSparkError, PromptError
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import Engine, EngineConfig
from dspark.target.model import TargetModel


def encode_conversation(target: TargetModel, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids for the next assistant turn: the chat template with ``CHAT_TEMPLATE_KWARGS`` for every turn,
    the first included (what a server renders for ``regenerate_http``'s request), else the plain text of a
    lone user message."""
    tok = target.tokenizer
    single = len(messages) == 1 and messages[0]["role"] == "user"
    if not getattr(tok, "chat_template", None):
        if single:
            return target.encode_chat(messages[0]["content"])
        raise PromptError("a multi-turn or system-prompt conversation needs a tokenizer with a chat template")
    if single and not messages[0]["content"].strip():
        raise PromptError("the prompt is empty")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **CHAT_TEMPLATE_KWARGS)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def turn_request(target: TargetModel, messages: list[dict[str, str]], seed: int, max_new_tokens: int,
                 temperature: float, top_p: float, top_k: int) -> tuple[list[int], SamplingParams]:
    """(prompt ids, sampling) of one turn; the budget shrinks to fit the context. Raises PromptError."""
    ids = encode_conversation(target, messages)
    target.check_prompt(ids)
    budget = min(max_new_tokens, target.max_context - len(ids))
    if budget < 1:
        raise PromptError(f"the prompt fills the model's context of {target.max_context} tokens")
    return ids, SamplingParams(temperature, top_k, top_p, budget, seed=seed)


def decode_reply(target: TargetModel, output_ids: list[int], finish_reason: str) -> str:
    if finish_reason == "stop" and output_ids:
        output_ids = output_ids[:-1]  # the stop token
    return target.tokenizer.decode(output_ids, skip_special_tokens=True)


class EngineTurns:
    """Answers turns through an ``Engine`` (no drafter) that runs while the object is entered."""

    def __init__(self, target: TargetModel, max_batch: int, max_new_tokens: int, temperature: float,
                 top_p: float, top_k: int) -> None:
        self.target = target
        # the caller keeps at most 2 * max_batch turns in flight; a finished turn holds its slot until the
        # engine's next step boundary, so the queue takes them all
        self.engine = Engine(target, config=EngineConfig(max_batch=max_batch, max_queue=2 * max_batch))
        self.sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)

    def __enter__(self) -> "EngineTurns":
        self.engine.start()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.stop()

    async def __call__(self, messages: list[dict[str, str]], seed: int) -> Reply:
        ids, sampling = turn_request(self.target, messages, seed, **self.sampling)
        handle = self.engine.submit(ids, sampling, loop=asyncio.get_running_loop())
        tokens: list[int] = []
        try:
            async for event in handle.stream():
                tokens.extend(event.token_ids)
                if event.finished and event.finish_reason not in ("stop", "length"):
                    raise DSparkError(f"the engine ended a request with '{event.finish_reason}': {event.error}")
        finally:
            if not handle.done:
                handle.cancel()
        return Reply(decode_reply(self.target, tokens, event.finish_reason), len(tokens))
