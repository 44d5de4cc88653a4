"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the continuous-batching engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming
as server-sent events ``data: {...}`` ... ``data: [DONE]``, or one JSON
answer), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus
text). ``/v1/*`` needs ``Authorization: Bearer <key>`` when an API key is set;
errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Request fields: ``model`` (optional; must name the served model), ``prompt`` /
``messages``, ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature`` (0 = greedy, the target's exact greedy output), ``top_p``,
``top_k`` (extension), ``seed``, ``stop`` (strings, matched on the decoded text:
best effort), ``stop_token_ids`` (extension), ``n`` (1 only),
``stream_options.include_usage``, ``return_token_ids`` (extension: the
generated ids in each choice). Unknown fields are ignored; OpenAI features
this server does not implement (logprobs, penalties, logit bias, tools, ...)
are refused with 400 rather than silently dropped.

Tokenisation lives here, in a worker thread (a huge prompt never blocks the
event loop); the engine sees token ids only. No single client can stall the
others: bodies over ``max_body_bytes`` get 413 before they are parsed, prompts
over ``max_prompt_tokens`` get 400, text that is not valid Unicode (a lone
UTF-16 surrogate) gets 400, and anything unexpected a JSON 500 in OpenAI's
shape, never a text/plain traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.errors import PromptError
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import Engine, EngineClosedError, QueueFullError, RequestHandle
from dspark.serving.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit, uvicorn_limits
from dspark.serving.metrics import CONTENT_TYPE, render_prometheus
from dspark.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    check_text,
    refuse_unsupported,
)
from dspark.serving.text import TextStream

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_STOP_STRINGS = 16


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the context)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 unread
    max_prompt_tokens: int | None = None  # longer prompts get 400 (None: the model's context)


# =============================================================== the app
def create_app(engine: Engine, tokenizer, config: ServerConfig, manage_engine: bool = True) -> FastAPI:
    """The FastAPI app. With ``manage_engine`` the app starts the engine at startup and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    max_context = engine.target.max_context
    max_prompt = min(config.max_prompt_tokens or max_context, max_context)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"invalid request: {where}: {first.get('msg', 'bad value')}" if where else "invalid request body"
        return APIError(400, message, param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        code = "request_too_large" if err.status_code == 413 else None
        return APIError(err.status_code, str(err.detail), "invalid_request_error", code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        return APIError(500, f"internal error: {type(err).__name__}", "server_error").response()

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def check_model(req: SamplingFields) -> None:
        check_text(req.model, "model")
        if req.model is not None and req.model != config.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{config.model_name}'",
                           param="model", code="model_not_found")

    def sampling_params(req: SamplingFields, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported; send several requests instead", param="n")
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise APIError(400, f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {temperature}",
                           param="temperature")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0.0 < top_p <= 1.0:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        if top_k < 0:
            raise APIError(400, f"top_k must be >= 0 (or -1 for off), got {req.top_k}", param="top_k")
        room = max_context - prompt_len
        if prompt_len > max_prompt and max_prompt < max_context:
            raise APIError(400, f"the prompt has {prompt_len} tokens but this server accepts at most {max_prompt}",
                           param="prompt", code="prompt_too_long")
        if prompt_len >= max_context:
            raise APIError(400, f"the prompt has {prompt_len} tokens but the model's context is {max_context} tokens; "
                           "shorten the prompt", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens, room)
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        elif max_tokens > room:
            raise APIError(400, f"the model's context is {max_context} tokens: the prompt has {prompt_len}, so "
                           f"max_tokens can be at most {room} (got {max_tokens})", param="max_tokens",
                           code="context_length_exceeded")
        stop_ids = list(req.stop_token_ids or [])
        bad = [t for t in stop_ids if not 0 <= t < engine.target.vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids {bad[:5]} are outside the vocabulary", param="stop_token_ids")
        seed = None if req.seed is None else req.seed % (2**63)
        return SamplingParams(temperature, top_k, top_p, max_tokens, seed, stop_ids)

    def stop_strings(req: SamplingFields) -> list[str]:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        check_text(stops, "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop")
        return stops

    def encode_prompt(req: CompletionRequest) -> list[int]:
        check_text(req.prompt, "prompt")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"send one prompt per request (got {len(prompt)})", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "the prompt is empty", param="prompt")
            return list(tokenizer.encode(prompt, add_special_tokens=True))
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return list(prompt)

    def encode_messages(req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise APIError(400, "messages is empty; send at least one message", param="messages")
        check_text(req.messages, "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"messages[{i}].role must be system, user or assistant, got {role!r}",
                               param=f"messages[{i}].role")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        if not any(m["content"].strip() for m in messages):
            raise APIError(400, "the messages are empty", param="messages")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def submit(prompt_ids: list[int], sampling: SamplingParams) -> RequestHandle:
        try:
            return engine.submit(prompt_ids, sampling, loop=asyncio.get_running_loop())
        except QueueFullError as err:
            raise APIError(429, str(err), "rate_limit_error", code="queue_full") from None
        except EngineClosedError as err:
            raise APIError(503, str(err), "server_error", code="shutting_down") from None
        except PromptError as err:
            raise APIError(400, str(err), param="prompt") from None

    # ------------------------------------------------------------ generation core
    async def watch_disconnect(request: Request, handle: RequestHandle) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                handle.cancel()
                return

    async def run(request: Request, handle: RequestHandle, text: TextStream) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish_reason) pairs; cancels the engine request when the consumer goes away."""
        watcher = asyncio.create_task(watch_disconnect(request, handle))
        try:
            async for event in handle.stream():
                if event.finish_reason in ("error", "abort", "cancelled"):
                    raise APIError(503 if event.finish_reason == "abort" else 500,
                                   event.error or f"generation ended: {event.finish_reason}", "server_error")
                delta = text.add(event.token_ids)
                if text.stopped:
                    handle.cancel("stop")
                    yield delta, "stop"
                    return
                if event.finished:
                    yield delta + text.flush(), event.finish_reason
                    return
                if delta:
                    yield delta, None
        finally:
            watcher.cancel()
            if not handle.done:
                handle.cancel()

    def usage(prompt_len: int, text: TextStream) -> dict[str, int]:
        n = len(text.token_ids)
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def respond(request: Request, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                      chat: bool):
        check_model(req)
        refuse_unsupported(req)
        sampling = sampling_params(req, len(prompt_ids), max_tokens)
        stops = stop_strings(req)
        handle = submit(prompt_ids, sampling)
        text = TextStream(tokenizer, stops)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": config.model_name}

        def choice(delta: str, finish: str | None, ids: list[int] | None) -> dict:
            c: dict[str, Any] = {"index": 0}
            if chat:
                c["delta"] = {"content": delta} if delta else {}
            else:
                c.update(text=delta, logprobs=None)
            c["finish_reason"] = finish
            if req.return_token_ids and ids is not None:
                c["token_ids"] = ids
            return c

        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))

            async def events() -> AsyncIterator[str]:
                sent = 0
                try:
                    if chat:
                        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        yield sse({**head, "choices": [first]})
                    async for delta, finish in run(request, handle, text):
                        ids = text.token_ids[sent:]
                        sent = len(text.token_ids)
                        yield sse({**head, "choices": [choice(delta, finish, ids)]})
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": usage(len(prompt_ids), text)})
                except APIError as err:
                    yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts: list[str] = []
        finish = None
        async for delta, finish in run(request, handle, text):
            parts.append(delta)
        content = "".join(parts)
        if chat:
            c: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                                 "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
        if req.return_token_ids:
            c["token_ids"] = list(text.token_ids)
        body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [c],
                "usage": usage(len(prompt_ids), text)}
        return JSONResponse(body)

    # ------------------------------------------------------------ routes
    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(req: CompletionRequest, request: Request):
        check_model(req)  # before the (threaded) tokenisation
        prompt_ids = await asyncio.to_thread(encode_prompt, req)
        return await respond(request, req, prompt_ids, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        check_model(req)
        prompt_ids = await asyncio.to_thread(encode_messages, req)
        return await respond(request, req, prompt_ids, max_tokens, chat=True)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models(request: Request):
        card = {"id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "dspark",
                "max_model_len": max_context}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not engine.running:
            raise APIError(503, "the engine is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_prometheus(engine.stats(), config.model_name), media_type=CONTENT_TYPE)

    return app


# =============================================================== running it
class ServerThread:
    """uvicorn in a background thread (tests, in-process benchmarks). Port 0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 **limits: Any) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    lifespan="on", **{**uvicorn_limits(), **limits}))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="dspark-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
