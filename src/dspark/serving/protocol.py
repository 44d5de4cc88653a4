"""The OpenAI wire format of the server: request bodies, errors in OpenAI's shape, input checks.

Errors are ``{"error": {"message", "type", "param", "code"}}``, rendered with every
non-ASCII character escaped so any string (a lone UTF-16 surrogate included) can be
echoed back. Strings a tokenizer cannot take (lone surrogates) are refused with 400.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class SafeJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: renders any string, a lone surrogate included."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = error_body(self.status, self.message, self.type, self.param, self.code)
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return SafeJSON(body, status_code=self.status, headers=headers)


def check_text(value: Any, param: str) -> None:
    """400 for a string that is not valid Unicode (JSON can carry a lone UTF-16 surrogate; no tokenizer can)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"'{param}' is not valid Unicode text (it holds a lone UTF-16 surrogate)",
                           param=param) from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, list, dict)):  # not for each id of a long token-id prompt
                check_text(item, f"{param}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(item, f"{param}.{key}")


# =============================================================== fields this server refuses
ANY = "any value"  # the field changes nothing on this server

# The request fields of vLLM's OpenAI server (vllm/entrypoints/openai/protocol.py: CompletionRequest and
# ChatCompletionRequest, i.e. OpenAI's fields, vLLM's sampling params and its extra params) that this server
# does not implement, each with the values that leave a request unchanged. A request may carry one only with
# such a value; any other value gets a 400 naming the field. ANY: the field has no effect here whatever its
# value (metadata; a cache salt on a server without a prefix cache; parallel_tool_calls without tools).
_SHARED = {
    # OpenAI
    "best_of": (None, 1),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "user": ANY,
    # vLLM sampling params
    "use_beam_search": (None, False),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "length_penalty": (None, 1),
    "ignore_eos": (None, False),
    "min_tokens": (None, 0),
    "spaces_between_special_tokens": (None, True),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    # vLLM extra params
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
    "priority": (None, 0),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "cache_salt": ANY,
    "kv_transfer_params": (None, {}),
    "vllm_xargs": (None, {}),
}
COMPLETION_UNSUPPORTED = {
    **_SHARED,
    "echo": (None, False),
    "logprobs": (None,),
    "suffix": (None, ""),
    "prompt_embeds": (None,),
}
CHAT_UNSUPPORTED = {
    **_SHARED,
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": ANY,
    "reasoning_effort": (None,),
    "include_reasoning": (None, True),
    "echo": (None, False),
    "documents": (None,),
    "chat_template": (None,),
    "mm_processor_kwargs": (None, {}),
    "structural_tag": (None,),
    # OpenAI chat fields vLLM's request does not list
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": ANY,
    "service_tier": ANY,
}


# =============================================================== request bodies
class SamplingFields(BaseModel):
    """The fields both endpoints implement. Any other field goes through ``refuse_unsupported``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: generation_config.json's, else 1
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    n: int | None = None  # 1 only
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_usage, continuous_usage_stats
    return_token_ids: bool = False  # vLLM extension: the generated ids in each choice
    include_stop_str_in_output: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    truncate_prompt_tokens: int | None = None  # vLLM extension: keep the last N prompt tokens
    request_id: str | None = None  # vLLM extension: the answer's id

    UNSUPPORTED: ClassVar[dict[str, Any]] = {}  # field -> values that change nothing (or ANY)


class CompletionRequest(SamplingFields):
    # str | list[str] | list[int] | list[list[int]], checked by ``prompt_value`` in a worker thread: pydantic's
    # union validation of a 1.4M-id list costs 2 s on the event loop (it collects an error per id for list[str])
    prompt: Any
    add_special_tokens: bool = True  # vLLM extension: BOS etc. added to a text prompt

    UNSUPPORTED: ClassVar[dict[str, Any]] = COMPLETION_UNSUPPORTED


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    # vLLM extensions: how the chat template is applied
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} for Qwen3
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # BOS etc. on top of what the template writes

    UNSUPPORTED: ClassVar[dict[str, Any]] = CHAT_UNSUPPORTED


def _is_id(x: Any) -> bool:
    return type(x) is int


def prompt_value(prompt: Any) -> str | list[int]:
    """The one prompt of a completion request (a string or token ids), or 400: str | list[str] | list[int] |
    list[list[int]], a list of prompts holding exactly one."""
    def bad(what: str) -> APIError:
        return APIError(400, f"invalid request: prompt: {what}; send a string, a list of token ids, or a list "
                        "holding one of those", param="prompt")

    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise bad(f"a {type(prompt).__name__} is not a prompt")
    if not prompt:
        return []
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"send one prompt per request (got {len(prompt)})", param="prompt")
        inner = prompt[0]
        if isinstance(inner, list) and not all(map(_is_id, inner)):
            raise bad("a token-id list holds something other than integers")
        return inner
    if not all(map(_is_id, prompt)):
        raise bad("a list mixing token ids with other values")
    return prompt


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")

def _neutral(value: Any, allowed: Any) -> bool:
    if allowed is ANY:
        return True
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


def refuse_unsupported(req: SamplingFields) -> None:
    """400 naming the first field this server would otherwise ignore: a known one set to a value that
    changes the output, or one neither vLLM nor OpenAI defines (OpenAI's "unrecognized request argument")."""
    for name, value in (req.model_extra or {}).items():
        allowed = type(req).UNSUPPORTED.get(name)
        if allowed is None:
            raise APIError(400, f"unrecognized request argument '{name}'; remove it from the request", param=name)
        if not _neutral(value, allowed):
            raise APIError(400, f"'{name}' is not supported by this server; remove it from the request", param=name)
    for key in req.stream_options or {}:
        if key not in STREAM_OPTIONS:
            raise APIError(400, f"stream_options.{key} is not supported (only {', '.join(STREAM_OPTIONS)})",
                           param=f"stream_options.{key}")
