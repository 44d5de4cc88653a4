"""Limits that keep one client from stalling the server: request-body size, a header-read timeout and
uvicorn's connection settings."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark.serving.protocol import SafeJSON, error_body

# a 6,000-token prompt is ~30 kB of JSON, a 128k-token one under 1 MB; the body is parsed on the event loop
# (json holds the GIL), about 0.1 s per MB here, so this bounds the stall one request can cause
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (declared in Content-Length, or counted as it streams)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await SafeJSON(self._body(), status_code=413)(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if seen > self.max_bytes:
                raise StarletteHTTPException(413, self._body()["error"]["message"])
            return message

        await self.app(scope, counted, send)

    def _body(self) -> dict:
        return error_body(413, f"the request body is over this server's limit of {self.max_bytes} bytes",
                           code="request_too_large")


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout and OpenAI-shaped answers to unparsable requests.

    A connection whose request head is not complete ``header_timeout_s`` after it opened or after its
    previous response ended is closed (slowloris). uvicorn has no such setting: its keep-alive timeout
    stops as soon as the first byte of a request arrives.
    """

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """What uvicorn sends when h11 cannot parse a request, as JSON in OpenAI's error shape (not text/plain)."""
        body = json.dumps(error_body(400, f"invalid HTTP request: {msg}")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def uvicorn_limits(max_connections: int | None = 1024, keep_alive_timeout_s: float = 5.0,
                   header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> dict[str, Any]:
    """uvicorn settings that keep one client from holding the server: a cap on concurrent connections
    (beyond it uvicorn answers 503), how long an idle keep-alive connection is kept, and how long a request
    head may take to arrive. How long shutdown lets requests run is the app's (``ServerConfig``,
    ``shutdown.Drain``); uvicorn's own graceful timeout only covers what is left after that drain."""
    from dspark.serving.shutdown import FORCE_GRACE_S

    protocol = type("GuardedH11", (GuardedH11,), {"header_timeout_s": header_timeout_s})
    return {"limit_concurrency": max_connections, "timeout_graceful_shutdown": FORCE_GRACE_S,
            "timeout_keep_alive": keep_alive_timeout_s, "http": protocol}
