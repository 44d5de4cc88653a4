"""Graceful shutdown of the HTTP server, as vLLM and SGLang users expect it.

On SIGTERM (or ``ServerThread.stop``) ``DrainingServer`` first drains, then lets uvicorn shut down:

1. stop admitting: every new request, on a new or a kept-alive connection, gets 503 in OpenAI's error
   shape (code ``shutting_down``) and ``/health`` answers 503, while the listening socket stays open so
   clients and load balancers see a clear answer rather than a refused connection;
2. the requests already running or queued in the engine go on until ``shutdown_timeout_s``;
3. at the timeout each remaining one is aborted: a stream ends with an error event and ``data: [DONE]``,
   a non-streaming request gets a 503 in OpenAI's shape;
4. uvicorn then closes the (now idle) connections, which leaves it nothing to cancel, so no
   ``CancelledError`` reaches the log, and the process exits 0 (a SIGTERM that was drained is not
   raised again).

The drain adds at most ``ABORT_GRACE_S`` + ``FORCE_GRACE_S`` to the timeout before the engine stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import weakref
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from dspark.serving.protocol import SafeJSON, error_body

log = logging.getLogger("dspark.serving")

SHUTTING_DOWN = "the server is shutting down; retry on another replica"
ABORT_GRACE_S = 1.0  # after the timeout: how long aborted responses get to send their last bytes
FORCE_GRACE_S = 0.5  # then: how long uvicorn waits for connections before it cancels their tasks
UNGATED = ("/health", "/metrics")  # answered while draining (/health itself says 503)


class Drain:
    """Requests in flight and the shutdown state of one app (``app.state.drain``)."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"the shutdown timeout must be >= 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.draining = False
        self.in_flight = 0  # HTTP requests being answered
        self.handles: weakref.WeakSet = weakref.WeakSet()  # engine requests of those answers
        self.aborted = 0  # requests ended by the timeout (the last drain)
        self._idle: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def enter(self) -> None:
        self.in_flight += 1
        self._event().clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._event().set()

    async def _wait_idle(self, seconds: float, give_up: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + seconds
        while self.in_flight and not give_up():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._event().wait(), timeout=min(left, 0.1))
            except asyncio.TimeoutError:
                pass
        return True

    async def run(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """Stop admitting, wait up to the timeout for the requests in flight, then abort the rest."""
        self.draining = True
        t0 = time.monotonic()
        if self.in_flight:
            log.info("draining %d request(s) for at most %.1f s", self.in_flight, self.timeout_s)
        if await self._wait_idle(self.timeout_s, give_up):
            return
        handles = [h for h in list(self.handles) if not h.done]
        self.aborted = len(handles)
        log.warning("shutdown timeout (%.1f s) reached: aborting %d request(s)", time.monotonic() - t0, len(handles))
        for handle in handles:
            handle.abort(SHUTTING_DOWN)
        await self._wait_idle(ABORT_GRACE_S, give_up)


class DrainGate:
    """ASGI middleware: counts the requests in flight; while draining, 503 in OpenAI's shape for new ones."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope.get("path") not in UNGATED:
            body = error_body(503, SHUTTING_DOWN, "server_error", code="shutting_down")
            return await SafeJSON(body, status_code=503, headers={"Connection": "close"})(scope, receive, send)
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above run before its own shutdown."""

    async def shutdown(self, sockets=None) -> None:
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if isinstance(drain, Drain) and not self.force_exit:
            await drain.run(lambda: self.force_exit)
        captured = getattr(self, "_captured_signals", None)
        if captured is not None and not self.force_exit:
            captured[:] = [s for s in captured if s != signal.SIGTERM]  # drained: exit 0, not by the signal
        await super().shutdown(sockets)
