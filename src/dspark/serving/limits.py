"""Limits that keep one client from stalling the server: request-body size and uvicorn's connection settings."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.serving.protocol import SafeJSON, error_body

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # a 6,000-token prompt is ~30 kB of JSON


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


def uvicorn_limits(max_connections: int | None = 1024, shutdown_timeout_s: float = 30.0,
                   keep_alive_timeout_s: float = 5.0) -> dict[str, Any]:
    """uvicorn settings that keep one client from holding the server: a cap on concurrent connections
    (beyond it uvicorn answers 503), how long shutdown waits for in-flight streams before closing them,
    and how long an idle keep-alive connection is kept."""
    return {"limit_concurrency": max_connections, "timeout_graceful_shutdown": shutdown_timeout_s,
            "timeout_keep_alive": keep_alive_timeout_s}
