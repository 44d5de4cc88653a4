"""The OpenAI wire format of the server: request bodies, errors in OpenAI's shape, input checks.

Errors are ``{"error": {"message", "type", "param", "code"}}``, rendered with every
non-ASCII character escaped so any string (a lone UTF-16 surrogate included) can be
echoed back. Strings a tokenizer cannot take (lone surrogates) are refused with 400.
"""

from __future__ import annotations

import json
from typing import Any

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
            check_text(item, f"{param}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(item, f"{param}.{key}")


# =============================================================== request bodies
class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    # OpenAI fields this server refuses when set to anything but their neutral value
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def refuse_unsupported(req: SamplingFields) -> None:
    unsupported = {
        "logprobs": req.logprobs not in (None, False, 0),
        "top_logprobs": req.top_logprobs not in (None, 0),
        "presence_penalty": req.presence_penalty not in (None, 0, 0.0),
        "frequency_penalty": req.frequency_penalty not in (None, 0, 0.0),
        "logit_bias": bool(req.logit_bias),
        "echo": bool(getattr(req, "echo", False)),
        "best_of": getattr(req, "best_of", None) not in (None, 1),
        "suffix": bool(getattr(req, "suffix", None)),
        "tools": bool(getattr(req, "tools", None)),
        "response_format": (getattr(req, "response_format", None) or {}).get("type", "text") != "text",
    }
    for param, bad in unsupported.items():
        if bad:
            raise APIError(400, f"'{param}' is not supported by this server; remove it from the request", param=param)
