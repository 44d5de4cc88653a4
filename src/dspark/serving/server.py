"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the continuous-batching engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming
as server-sent events ``data: {...}`` ... ``data: [DONE]``, or one JSON
answer), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus
text). ``/v1/*`` needs ``Authorization: Bearer <key>`` when an API key is set;
errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Request fields: ``model`` (optional; must name the served model), ``prompt`` /
``messages``, ``max_tokens`` (chat also ``max_completion_tokens``; default: the room
left in the context, capped by ``--default-max-tokens`` when given), ``temperature``
(0 = greedy, the target's exact greedy output), ``top_p``, ``top_k``, ``seed``,
``stop`` (strings, matched on the decoded text), ``n`` (1 only),
``stream_options.include_usage`` / ``continuous_usage_stats``, and vLLM's extensions
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``truncate_prompt_tokens``, ``add_special_tokens``, ``request_id``,
``return_token_ids`` (the generated ids in each choice) and, for chat,
``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``),
``add_generation_prompt``, ``continue_final_message``. Sampling fields a request
omits take the model folder's generation_config.json values (``params``). Every
other field of vLLM's or OpenAI's request (logprobs, penalties, min_p, ignore_eos,
guided decoding, tools, ...) is refused with a 400 naming it unless it has its
neutral value, and a field neither defines gets 400 as unrecognised: nothing is
silently ignored (``protocol``). Usage counts the tokens of the returned text: a
stop string ends it even when a speculative step committed tokens past it.

Tokenisation (``prompts``) runs in a worker thread (a huge prompt never blocks the
event loop); the engine sees token ids only. No single client can stall the
others: bodies over ``max_body_bytes`` get 413 before they are parsed, prompts
over ``max_prompt_tokens`` get 400, text that is not valid Unicode (a lone
UTF-16 surrogate) gets 400, and anything unexpected a JSON 500 in OpenAI's
shape, never a text/plain traceback. Connections whose request head does not
arrive within the header timeout are closed (``limits.GuardedH11``), and the
engine prefills long prompts in chunks between decode steps. Stop strings are
bounded in count and length and matched in linear time (``text.StopMatcher``);
``chat_template_kwargs`` may not name what the template call sets itself
(``prompts.reserved_template_names``); a text prompt too long to fit is refused
before it is tokenised.

Shutdown (``shutdown``): new requests get 503 at once, running ones go on until
``shutdown_timeout_s``, then every stream ends with an error event and
``data: [DONE]`` and every other request with a 503, all in OpenAI's shape.
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.errors import PromptError
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import Engine, EngineClosedError, QueueFullError, RequestHandle
from dspark.serving.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit, uvicorn_limits
from dspark.serving.memory import Trimmer
from dspark.serving.metrics import CONTENT_TYPE, ServerMetrics
from dspark.serving.params import ContextBudget, SamplingDefaults, sampling_params, stop_strings, truncate_prompt
from dspark.serving.prompts import encode_messages, encode_prompt
from dspark.serving.shutdown import SHUTTING_DOWN, Drain, DrainGate, DrainingServer
from dspark.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    check_text,
    error_body,
    refuse_unsupported,
)
from dspark.serving.text import TextStream


ENGINE_STOP_S = 0.25  # at shutdown, how long to wait for the engine thread's last step (a daemon thread)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    default_max_tokens: int | None = None  # cap on max_tokens when a request gives none (None: the context left)
    sampling_defaults: SamplingDefaults | None = None  # None: the target folder's generation_config.json
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 unread
    max_prompt_tokens: int | None = None  # longer prompts get 400 (None: the model's context)
    shutdown_timeout_s: float = 30.0  # on shutdown, how long running requests may go on (``shutdown``)
    malloc_trim_every: int = 0  # return free heap pages to the system every N requests (``memory``; 0: never)


# =============================================================== the app
def create_app(engine: Engine, tokenizer, config: ServerConfig, manage_engine: bool = True) -> FastAPI:
    """The FastAPI app. With ``manage_engine`` the app starts the engine at startup and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:  # the drain has ended every request: the engine thread only has to finish its step
            await asyncio.to_thread(engine.stop, ENGINE_STOP_S)

    app = FastAPI(title="dspark", lifespan=lifespan)
    drain = app.state.drain = Drain(config.shutdown_timeout_s)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(DrainGate, drain=drain)  # outermost: a draining server answers 503 before reading a body
    max_context = engine.target.max_context
    budget = ContextBudget(max_context, min(config.max_prompt_tokens or max_context, max_context),
                           engine.target.vocab_size, config.default_max_tokens)
    defaults = config.sampling_defaults
    if defaults is None:
        defaults = SamplingDefaults.from_folder(engine.target.path)
    metrics = ServerMetrics(engine.stats, config.model_name, max_context)
    trimmer = Trimmer(config.malloc_trim_every)

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

    def submit(prompt_ids: list[int], sampling: SamplingParams) -> RequestHandle:
        if drain.draining:  # it arrived before the drain began, and was tokenised since
            raise APIError(503, SHUTTING_DOWN, "server_error", code="shutting_down")
        try:
            handle = engine.submit(prompt_ids, sampling, loop=asyncio.get_running_loop())
            drain.handles.add(handle)
            return handle
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

    async def run(request: Request, handle: RequestHandle, text: TextStream,
                  arrival: float) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish_reason) pairs; cancels the engine request when the consumer goes away."""
        watcher = asyncio.create_task(watch_disconnect(request, handle))
        last = None  # when the previous tokens arrived
        try:
            async for event in handle.stream():
                if event.finish_reason == "abort":  # the engine or the server is shutting down
                    raise APIError(503, event.error or SHUTTING_DOWN, "server_error", code="shutting_down")
                if event.finish_reason in ("error", "cancelled"):
                    raise APIError(500, event.error or f"generation ended: {event.finish_reason}", "server_error")
                if event.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        metrics.ttft.observe(now - arrival)
                    else:
                        metrics.tokens(len(event.token_ids), now - last)
                    last = now
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
            drain.handles.discard(handle)
            if not handle.done:
                handle.cancel()
            metrics.request_done(time.perf_counter() - arrival, len(handle.prompt_ids), text.num_tokens,
                                 handle.stats)
            trimmer.done()

    def usage(prompt_len: int, text: TextStream) -> dict[str, int]:
        n = text.num_tokens
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def check_request(req: SamplingFields) -> None:
        """The checks that need no tokenizer, before the (threaded) tokenisation."""
        check_model(req)
        refuse_unsupported(req)
        check_text(req.request_id, "request_id")

    async def respond(request: Request, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                      chat: bool, arrival: float):
        prompt_ids = truncate_prompt(req, prompt_ids)
        sampling = sampling_params(req, len(prompt_ids), max_tokens, defaults, budget)
        text = TextStream(tokenizer, stop_strings(req), req.skip_special_tokens, req.include_stop_str_in_output)
        handle = submit(prompt_ids, sampling)
        rid = ("chatcmpl-" if chat else "cmpl-") + (req.request_id or uuid.uuid4().hex)
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": config.model_name}

        def choice(delta: str, finish: str | None, ids: list[int]) -> dict:
            c: dict[str, Any] = {"index": 0}
            if chat:
                c["delta"] = {"content": delta} if delta else {}
            else:
                c.update(text=delta, logprobs=None)
            c["finish_reason"] = finish
            if req.return_token_ids:
                c["token_ids"] = ids
            return c

        if req.stream:
            options = req.stream_options or {}
            include_usage, every_chunk = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))

            async def events() -> AsyncIterator[str]:
                sent = 0  # token ids already sent
                try:
                    if chat:
                        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        yield sse({**head, "choices": [first]})
                    async for delta, finish in run(request, handle, text, arrival):
                        ids = text.output_ids[sent:]
                        sent += len(ids)
                        chunk = {**head, "choices": [choice(delta, finish, ids)]}
                        if every_chunk:
                            chunk["usage"] = usage(len(prompt_ids), text)
                        yield sse(chunk)
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": usage(len(prompt_ids), text)})
                except APIError as err:
                    yield sse(error_body(err.status, err.message, err.type, err.param, err.code))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts: list[str] = []
        finish = None
        async for delta, finish in run(request, handle, text, arrival):
            parts.append(delta)
        content = "".join(parts)
        if chat:
            c: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                                 "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
        if req.return_token_ids:
            c["token_ids"] = text.output_ids
        body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [c],
                "usage": usage(len(prompt_ids), text)}
        return JSONResponse(body)

    # ------------------------------------------------------------ routes
    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(req: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        check_request(req)
        prompt_ids = await asyncio.to_thread(encode_prompt, tokenizer, req, budget.max_prompt)
        return await respond(request, req, prompt_ids, req.max_tokens, False, arrival)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        check_request(req)
        prompt_ids = await asyncio.to_thread(encode_messages, tokenizer, req, budget.max_prompt)
        return await respond(request, req, prompt_ids, max_tokens, True, arrival)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models(request: Request):
        card = {"id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "dspark",
                "max_model_len": max_context}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if drain.draining:
            raise APIError(503, SHUTTING_DOWN, "server_error", code="shutting_down")
        if not engine.running:
            raise APIError(503, "the engine is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


# =============================================================== running it
class ServerThread:
    """uvicorn in a background thread (tests, in-process benchmarks). Port 0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 **limits: Any) -> None:
        import uvicorn

        self.server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
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
