"""The engine core in a process of its own (as vLLM's EngineCore), behind the ``Engine`` interface.

The HTTP process keeps the event loop, tokenisation, detokenisation and streaming; the core process
runs an ``Engine`` (target, drafter, verify policy, its engine thread) and nothing else. In one
process the engine thread and the event loop share one GIL: whenever the OS preempts the engine thread
while it holds the GIL (a busy machine does so often), the loop waits until the engine runs again, so
/health and every stream inherit the engine's scheduling delays (docs/reports/reliability.md, "Where /health
waited"). Two processes have two GILs.

Protocol: one duplex ``multiprocessing`` pipe carrying pickled tuples.

- HTTP -> core: ``("submit", key, request_id, prompt_ids, sampling)``, ``("cancel", key, reason)``,
  ``("stop",)``.
- core -> HTTP: ``("ready", TargetInfo, EngineConfig, EngineStats)`` once (or ``("failed", error)``),
  then ``("events", [(key, StreamEvent, AcceptanceStats | None), ...], EngineStats | None)``: every
  event the engine emitted since the last message, and now and then the engine's counters.

``EngineProcess.submit`` needs no round trip: it checks the prompt against ``TargetInfo`` (the
target's own ``check_prompt``) and counts its open requests against ``max_batch + max_queue`` itself,
raising ``PromptError`` / ``QueueFullError`` / ``EngineClosedError`` as ``Engine.submit`` does.

A crash of the core (killed, out of memory, a fault in native code) closes the pipe: every open request
then ends with finish_reason ``"error"`` naming the exit code (a stream gets an error event and
``data: [DONE]``, another request a 500), ``running`` turns False (/health answers 503) and new
requests get 503. The core ignores SIGINT and SIGTERM (the HTTP process drains and then stops it) and
exits when the HTTP process goes away.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dspark.errors import DSparkError, ModelLoadError
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import (
    Engine,
    EngineClosedError,
    EngineConfig,
    QueueFullError,
    RequestHandle,
    StreamEvent,
)
from dspark.serving.engine_stats import EngineStats
from dspark.serving.memory import Trimmer
from dspark.target.model import TargetModel

log = logging.getLogger("dspark.serving")

STATS_EVERY_S = 0.5  # how often the core sends its counters when nothing finishes
CORE_STOP_S = 0.25  # at stop: how long the core waits for its engine thread's last step
CORE_EXIT_S = 3.0  # at stop: how long the HTTP process waits for the core to exit before killing it


@dataclass(frozen=True)
class TargetInfo:
    """What the HTTP process needs to know of the target (its weights stay in the core)."""

    name: str
    path: Path | None
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    device_name: str  # "cpu", "cuda:0", ...
    kv_bytes_per_token: int = 0  # KV cache bytes per position of one request

    check_prompt = TargetModel.check_prompt  # the same checks, on the same two numbers

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_name)

    @classmethod
    def of(cls, target: TargetModel) -> "TargetInfo":
        return cls(target.name, target.path, target.vocab_size, target.max_context, tuple(target.eos_token_ids),
                   str(target.device), target.kv_bytes_per_token)


# =============================================================== the HTTP side
class EngineProcess:
    """``Engine``'s interface (submit, stats, running, start/stop) over an engine core in a child process.

    ``build(*build_args)`` runs in the child (spawned, so it must be picklable: a module-level function and
    plain arguments) and returns the ``Engine`` to serve. ``start`` blocks until the core is ready and
    raises the error its build raised, if any.
    """

    def __init__(self, build: Callable[..., Engine], *build_args, start_timeout_s: float = 900.0) -> None:
        self._build, self._build_args = build, build_args
        self.start_timeout_s = start_timeout_s
        self.target: TargetInfo | None = None  # set by start()
        self.config: EngineConfig | None = None
        self._proc: multiprocessing.Process | None = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the fields below
        self._open: dict[int, RequestHandle] = {}
        self._keys = itertools.count()
        self._closing = False
        self._dead: str | None = None  # why the core is gone, when it went away by itself
        self._stats = EngineStats()
        self._rejected = 0
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "EngineProcess":
        if self._proc is not None:
            if self._closing or self._dead:
                raise EngineClosedError("the engine process was stopped; create a new one")
            return self
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or OpenMP pool copied
        conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_core_main, args=(child, self._build, self._build_args),
                                 name="dspark-engine-core", daemon=True)
        self._proc.start()
        child.close()
        self._dead = "the engine process did not start"  # until it says it is ready
        try:
            if not conn.poll(self.start_timeout_s):
                raise ModelLoadError(f"the engine process was not ready after {self.start_timeout_s:.0f} s")
            msg = conn.recv()
        except EOFError:
            self._proc.join(5)
            raise ModelLoadError(f"the engine process exited (code {self._proc.exitcode}) before it was ready") from None
        except BaseException:
            self._proc.kill()
            raise
        if msg[0] == "failed":
            self._proc.join(5)
            raise msg[1]
        self._dead = None
        _, self.target, self.config, self._stats = msg
        self._conn = conn
        self._reader = threading.Thread(target=self._read, name="dspark-engine-reader", daemon=True)
        self._reader.start()
        return self

    def stop(self, timeout: float | None = CORE_EXIT_S) -> None:
        """Refuse new requests, stop the core (its open requests end with "abort") and reap it."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._proc is None:
            return
        self._send(("stop",))
        self._proc.join(CORE_EXIT_S if timeout is None else max(timeout, CORE_EXIT_S))
        if self._proc.is_alive():
            log.warning("the engine process did not stop in time; killing it")
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None:
            self._reader.join(5)
        self._fail_open("abort", "the engine stopped")

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return (self._proc is not None and self._proc.is_alive() and self._dead is None and not self._closing)

    @property
    def pid(self) -> int | None:
        """The core's process id."""
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------ requests
    def check_request(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.target.check_prompt(prompt_ids, sampling.max_new_tokens)

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """As ``Engine.submit``: raises PromptError, QueueFullError or EngineClosedError."""
        if self.target is None:
            raise EngineClosedError("the engine process is not started")
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, sampling)
        with self._lock:
            if self._dead is not None:
                raise EngineClosedError(f"{self._dead}; retry on another replica")
            if self._closing:
                raise EngineClosedError("the server is shutting down; retry on another replica")
            limit = self.config.max_batch + self.config.max_queue
            if len(self._open) >= limit:
                self._rejected += 1
                raise QueueFullError(f"all {self.config.max_batch} slots are busy and the queue is full "
                                     f"(max_queue {self.config.max_queue}); retry later")
            key = next(self._keys)
            handle = RequestHandle(request_id or f"req-{key}", prompt_ids, sampling, self, loop)
            handle._key = key
            self._open[key] = handle
        self._send(("submit", key, handle.request_id, prompt_ids, sampling))
        return handle

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, timeout: float | None = None) -> list[int]:
        return self.submit(prompt_ids, sampling).result(timeout)[0]

    def _on_cancel(self, handle: RequestHandle) -> None:  # RequestHandle.cancel calls it
        with self._lock:
            is_open = self._open.get(handle._key) is handle
        if is_open:
            self._send(("cancel", handle._key, handle.cancel_reason))

    def stats(self) -> EngineStats:
        """The core's counters as of its last message (at most ``STATS_EVERY_S`` old), with the
        requests this side refused."""
        with self._lock:
            stats, rejected = self._stats, self._rejected
        requests = dict(stats.requests)
        if rejected:
            requests["rejected"] = requests.get("rejected", 0) + rejected
        return replace(stats, requests=requests)

    # ------------------------------------------------------------ the pipe
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError, AttributeError):  # the core is gone: the reader fails the open requests
            pass

    def _read(self) -> None:
        """Deliver the core's events to their handles until the pipe closes."""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] != "events":
                continue
            _, events, stats = msg
            for key, event, acceptance in events:
                with self._lock:
                    handle = self._open.pop(key, None) if event.finished else self._open.get(key)
                if handle is None:
                    continue
                if acceptance is not None:
                    handle.stats = acceptance
                handle._emit(event)
            if stats is not None:
                with self._lock:
                    self._stats = stats
        self._proc.join(1)
        with self._lock:
            closing = self._closing
            if not closing:
                self._dead = f"the engine process exited unexpectedly (exit code {self._proc.exitcode})"
        if not closing:
            log.error("%s; failing its open requests", self._dead)
            self._fail_open("error", self._dead)

    def _fail_open(self, reason: str, message: str) -> None:
        with self._lock:
            handles, self._open = list(self._open.values()), {}
        for handle in handles:
            handle._emit(StreamEvent([], reason, message))


# =============================================================== the core process
class _Core:
    """The child's side: submit/cancel from the pipe into the engine, events back in batches."""

    _STOP = object()

    def __init__(self, engine: Engine, conn) -> None:
        self.engine, self.conn = engine, conn
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # (key, StreamEvent, AcceptanceStats | None)
        self.handles: dict[int, RequestHandle] = {}  # open requests by key
        self.lock = threading.Lock()
        self.trimmer = Trimmer(64)  # native memory freed by finished requests goes back to the system

    def sink(self, key: int) -> Callable[[RequestHandle, StreamEvent], None]:
        def emit(handle: RequestHandle, event: StreamEvent) -> None:
            if event.finished:
                with self.lock:
                    self.handles.pop(key, None)
                self.trimmer.done()
            self.outbox.put((key, event, handle.stats if event.finished else None))
        return emit

    def run(self) -> None:
        sender = threading.Thread(target=self._send_loop, name="dspark-core-sender", daemon=True)
        sender.start()
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the HTTP process went away
                break
            if msg[0] == "submit":
                _, key, request_id, prompt_ids, sampling = msg
                try:
                    handle = self.engine.submit(prompt_ids, sampling, request_id, sink=self.sink(key))
                except DSparkError as err:  # checked on the HTTP side already; a race with the queue limit
                    self.outbox.put((key, StreamEvent([], "error", str(err)), None))
                    continue
                with self.lock:
                    if not handle.done:
                        self.handles[key] = handle
            elif msg[0] == "cancel":
                with self.lock:
                    handle = self.handles.get(msg[1])
                if handle is not None:
                    handle.cancel(msg[2] or "cancelled")
            elif msg[0] == "stop":
                break
        self.engine.stop(CORE_STOP_S)  # the open requests end with "abort", through the sinks
        self.outbox.put(self._STOP)
        sender.join(5)

    def _send_loop(self) -> None:
        last_stats = 0.0
        while True:
            try:
                items = [self.outbox.get(timeout=STATS_EVERY_S)]
            except queue.Empty:
                items = []
            while True:  # everything emitted meanwhile goes in the same message
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            stop = self._STOP in items
            events = [i for i in items if i is not self._STOP]
            now = time.monotonic()
            stats = None
            if stop or now - last_stats >= STATS_EVERY_S or any(e[1].finished for e in events):
                stats, last_stats = self.engine.stats(), now
            if events or stats is not None:
                try:
                    self.conn.send(("events", events, stats))
                except (OSError, ValueError):
                    return
            if stop:
                return


def _core_main(conn, build: Callable[..., Engine], build_args: tuple) -> None:
    """The child process: build the engine, serve the pipe, exit without the interpreter's slow teardown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM reach the HTTP process, which drains
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and then stops this one
    try:
        engine = build(*build_args)
        limits = replace(engine.config)  # what the HTTP side enforces, counting its open requests
        # the core takes whatever it is sent: a request the HTTP side admitted just after another's final
        # event must not meet a slot the engine has not released yet
        engine.config.max_queue = 2**31
        engine.start()
        conn.send(("ready", TargetInfo.of(engine.target), limits, engine.stats()))
    except BaseException as err:  # noqa: BLE001 - report it to the parent, which raises it
        try:
            conn.send(("failed", err))
        except Exception:  # noqa: BLE001 - not picklable: send its text
            conn.send(("failed", DSparkError(f"{type(err).__name__}: {err}")))
        os._exit(1)
    _Core(engine, conn).run()
    conn.close()
    os._exit(0)
