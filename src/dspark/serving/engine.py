"""Continuous-batching engine: one background thread runs speculative steps over the active batch.

The engine works on token ids only (no tokenizer, no HTTP). Requests join a
bounded waiting queue with ``submit``; between two steps the engine thread

1. drops cancelled requests (a client that went away frees its slot here),
2. admits waiting requests up to ``max_batch`` active ones,
3. runs one ``speculative_step`` (draft -> policy -> flattened verify ->
   commit; each request's KV cache, a slot of the target's ``KVPool``, rolls back
   inside it) over all active requests,
4. feeds at most ``prefill_chunk`` prompt tokens of the admitted, not yet
   prefilled requests to the target in a pass of its own
   (``dspark.generation.step.prefill``; with ``mix_prefill``, in step 3's
   target pass when requests are decoding: the weights are read once); a request
   whose prompt is complete gets its first token and joins the batch,
5. streams each request's committed tokens to its handle and retires the
   finished ones.

Chunked prefill (step 4) keeps a long prompt from stalling the other streams: between two of their
steps the target sees at most one chunk of prompt. Pieces leave the same cache, context features and
first token as a whole prompt, so outputs do not depend on the chunk size.

Every request has its own ``torch.Generator`` seeded from its ``seed``. With a
drafter and policy whose verify lengths depend only on the request itself
(``all``, ``fixed:N``, ``threshold:T``, deterministic or per-request-seeded
drafters) a seed reproduces a sampled output whatever else is in the batch;
``alg1`` / ``async`` size the verification from the whole batch, so there a seed
reproduces the output only for the same batch schedule (the output
distribution is the target's either way). Both hold bitwise with
``batch_invariant`` (prompt chunks in passes of their own); by default a chunk
rides in the decode step's pass (``mix_prefill``), where bf16 matmuls of more
rows can round a decoding row differently, so a near-tie can then flip a greedy
token with the load (the target's greedy text either way, at bf16 rounding).

Handles deliver ``StreamEvent``s to an asyncio queue (``submit(...,
loop=...)``: the server with the engine as its thread), to a callback
(``sink``: the engine core of ``dspark.serving.engine_process``, which forwards
them to the HTTP process), or to a thread-safe queue (tests, scripts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass

from dspark.drafters.base import Drafter, NoDrafter, RequestState
from dspark.errors import DSparkError, PromptError
from dspark.generation.stats import AcceptanceStats
from dspark.generation.step import PrefillPieces, prefill, speculative_step
from dspark.modeling.kv_cache import BLOCK, KVCache
from dspark.sampling.processing import SamplingParams
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import VerifyPolicy
from dspark.serving.engine_stats import EngineStats, StepTimes
from dspark.serving.prefix_cache import PrefixCache
from dspark.target.model import TargetModel

log = logging.getLogger("dspark.serving")

#: initial KV-cache room for generated tokens; caches grow by doubling beyond it
_INITIAL_GEN_CAPACITY = 256


def kv_cache_bound(bytes_per_token: int, max_batch: int, max_context: int, prefix_cache: int = 0) -> int:
    """The most bytes the target's KV pool can reach under an engine with ``max_batch`` slots and ``prefix_cache``
    kept prompts (each holds a slot).

    The pool (``dspark.modeling.kv_cache.KVPool``) gives every slot the same capacity: slots double from one
    when all are taken, so at most the next power of two >= ``max_batch + prefix_cache``; capacity doubles up to
    the model's context, rounded up to whole key blocks. Bytes = slots x capacity x ``bytes_per_token``.
    """
    slots = 1 << max(max_batch + prefix_cache - 1, 0).bit_length()
    return slots * (-(-max_context // BLOCK) * BLOCK) * bytes_per_token


class QueueFullError(DSparkError):
    """The waiting queue is full; the server answers 429."""


class EngineClosedError(DSparkError):
    """The engine is shutting down or stopped; the server answers 503."""


@dataclass
class EngineConfig:
    max_batch: int = 8  # most requests in the active batch
    max_queue: int = 64  # most requests waiting for a slot; beyond it submit() raises QueueFullError
    draft_cap: int | None = None  # most draft tokens per request per step (None: the drafter's block size)
    prefill_chunk: int | None = 256  # most prompt tokens prefilled between two decode steps (None: whole prompts)
    # feed the chunk in the decode step's target pass (the weights read once for both) instead of a pass of its own,
    # as vLLM's chunked prefill does; it moves the decoding rows into larger matmuls, whose bf16 kernels round some
    # rows differently (docs/architecture.md §Making a step cheap), so greedy text can then depend on the load
    mix_prefill: bool = True
    # a request's text does not depend on what else the engine runs: each prompt in pieces of its own, cut at multiples
    # of prefill_chunk, in passes of their own (mix_prefill off), as far as the kernels allow (docs/architecture.md
    # §Making a step cheap says exactly what holds)
    batch_invariant: bool = False
    # positions per slot the target's KV pool holds for all max_batch (+ prefix_cache) slots from start(); it grows
    # past them by doubling when a longer request comes, a copy of the whole pool into fresh memory, which under load
    # can stall the engine for seconds (docs/serving/README.md); 0 = start empty and grow on demand
    kv_reserve: int = 0
    # prompts kept after their requests finish (their KV-cache slots), so that a prompt sharing a prefix with one of
    # them skips that part of its prefill (dspark.serving.prefix_cache); 0 = off. Each holds a slot of the pool's
    # capacity: pair it with a kv_reserve that covers the prompts, or the pool grows under load
    prefix_cache: int = 0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.draft_cap is not None and self.draft_cap < 0:
            raise ValueError(f"draft_cap must be >= 0 or None, got {self.draft_cap}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 or None, got {self.prefill_chunk}")
        if self.kv_reserve < 0:
            raise ValueError(f"kv_reserve must be >= 0, got {self.kv_reserve}")
        if self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be >= 0, got {self.prefix_cache}")


@dataclass(frozen=True)
class StreamEvent:
    """Tokens committed for one request since its last event; the last event has a finish_reason."""

    token_ids: list[int]
    finish_reason: str | None = None  # None while running; "stop" | "length" | "cancelled" | "abort" | "error"
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestHandle:
    """The caller's side of one request: its event stream and ``cancel``."""

    def __init__(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 engine: "Engine", loop: asyncio.AbstractEventLoop | None,
                 sink: Callable[["RequestHandle", StreamEvent], None] | None = None) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.submitted_at = time.perf_counter()
        self.stats: AcceptanceStats | None = None  # per-request acceptance, set by the engine
        self._engine = engine
        self._loop = loop
        self._sink = sink  # instead of a queue: called with every event (the engine process forwards them)
        self._aqueue: asyncio.Queue[StreamEvent] | None = asyncio.Queue() if loop is not None else None
        self._squeue: queue.Queue[StreamEvent] | None = queue.Queue() if loop is None and sink is None else None
        self._cancel_reason: str | None = None
        self._done = False
        self._emit_lock = threading.Lock()  # abort() emits from the caller's thread, the engine from its own

    # -------------------------------------------------------- engine side
    def _emit(self, event: StreamEvent) -> None:
        with self._emit_lock:
            if self._done:
                return
            self._done = event.finished
        if self._sink is not None:
            self._sink(self, event)
            return
        if self._squeue is not None:
            self._squeue.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, event)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens any more
            self._cancel_reason = self._cancel_reason or "cancelled"

    @property
    def cancel_reason(self) -> str | None:
        return self._cancel_reason

    @property
    def done(self) -> bool:
        """True once the engine has emitted the finishing event."""
        return self._done

    # -------------------------------------------------------- caller side
    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generating; the slot is freed at the next step boundary. Idempotent."""
        if self._cancel_reason is None:
            self._cancel_reason = reason
            self._engine._on_cancel(self)

    def abort(self, message: str) -> None:
        """End the stream now with finish_reason "abort" and ``message`` (the server's shutdown), without
        waiting for the engine's next step boundary; the engine frees the slot at that boundary."""
        self.cancel("abort")
        self._emit(StreamEvent([], "abort", message))

    async def stream(self) -> AsyncIterator[StreamEvent]:
        """Events until the finishing one (needs ``submit(..., loop=...)``)."""
        if self._aqueue is None:
            raise RuntimeError("this request was submitted without an event loop; use events()")
        while True:
            event = await self._aqueue.get()
            yield event
            if event.finished:
                return

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Blocking iteration over the events (requests submitted without a loop)."""
        if self._squeue is None:
            raise RuntimeError("this request was submitted with an event loop; use stream()")
        while True:
            event = self._squeue.get(timeout=timeout)
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> tuple[list[int], str]:
        """Block until done: (generated token ids, finish_reason)."""
        tokens: list[int] = []
        for event in self.events(timeout):
            tokens.extend(event.token_ids)
            if event.finish_reason == "error":
                raise RuntimeError(f"request {self.request_id} failed in the engine: {event.error}")
        return tokens, event.finish_reason


@dataclass
class _Active:
    handle: RequestHandle
    state: RequestState
    cache: KVCache


class Engine:
    """Continuous batching around ``speculative_step``. Use as a context manager or start()/stop()."""

    def __init__(self, target: TargetModel, drafter: Drafter | None = None,
                 policy: VerifyPolicy | ConfidenceAdapter | None = None, config: EngineConfig | None = None) -> None:
        self.target = target
        self.drafter = drafter or NoDrafter(target.vocab_size)
        self.policy = policy  # None = verify every proposed draft
        self.config = config or EngineConfig()
        self._cv = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._active: list[_Active] = []  # decoding
        self._prefilling: list[_Active] = []  # admitted, prompt partly fed (engine thread only), oldest first
        self._num_active = 0  # slots held: active + admitted-but-not-yet-prefilled (read under the lock)
        self._cancel_pending = False
        self._paused = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._stats = EngineStats(max_batch=self.config.max_batch, max_queue=self.config.max_queue)
        self.step_times = StepTimes()  # pass times by batch tokens: the SPS table this load saw
        c = self.config
        # batch-invariant: reuse only whole prefill pieces (a fresh prefill cuts there too); whole-prompt passes: none
        invariant_off = c.batch_invariant and c.prefill_chunk is None
        self._prefix = PrefixCache(0 if invariant_off else c.prefix_cache,
                                   align=c.prefill_chunk if c.batch_invariant and c.prefill_chunk else 1)

    # ================================================================ public API
    def start(self) -> "Engine":
        with self._cv:
            if self._closing:
                raise EngineClosedError("the engine was stopped; create a new one")
            if self._thread is None:
                if self.config.kv_reserve:  # the batch's slots and the prefix cache's
                    self.target.reserve_cache(self.config.max_batch + self._prefix.max_entries, self.config.kv_reserve)
                self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
                self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests, abort the remaining ones (finish_reason "abort") and join the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cv:
            leftovers = [a.handle for a in self._active + self._prefilling] + list(self._waiting)
            self._active.clear()
            self._prefilling.clear()
            self._waiting.clear()
            self._num_active = 0
        for handle in leftovers:
            self._finish(handle, "abort")
        self._prefix.clear()  # the kept slots go back to the target's pool

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def pause(self) -> None:
        """Hold at the next step boundary: nothing is admitted or stepped (cancellations still apply)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def check_request(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise PromptError if the request can never run (empty, bad ids, too long for the context)."""
        self.target.check_prompt(prompt_ids, sampling.max_new_tokens)
        total = len(prompt_ids) + sampling.max_new_tokens
        if total > self.target.max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens and {sampling.max_new_tokens} new tokens were asked for, "
                f"but the model's context is {self.target.max_context}; ask for at most "
                f"{self.target.max_context - len(prompt_ids)} new tokens or shorten the prompt"
            )

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None,
               sink: Callable[[RequestHandle, StreamEvent], None] | None = None) -> RequestHandle:
        """Queue a request. Raises PromptError, QueueFullError (all slots busy and queue full) or EngineClosedError.

        Events go to an asyncio queue (``loop``), to ``sink`` (called on the engine thread), or to a
        thread-safe queue (neither)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, sampling)
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(rid, prompt_ids, sampling, self, loop, sink)
        with self._cv:
            if self._closing:
                self._count_locked("rejected")
                raise EngineClosedError("the server is shutting down; retry on another replica")
            if self._num_active + len(self._waiting) >= self.config.max_batch + self.config.max_queue:
                self._count_locked("rejected")
                raise QueueFullError(
                    f"all {self.config.max_batch} slots are busy and {len(self._waiting)} requests are waiting "
                    f"(max_queue {self.config.max_queue}); retry later"
                )
            self._waiting.append(handle)
            self._stats.queue_depth = len(self._waiting)
            self._cv.notify_all()
        return handle

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, timeout: float | None = None) -> list[int]:
        """Blocking convenience: submit and wait for the generated ids."""
        return self.submit(prompt_ids, sampling).result(timeout)[0]

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(**asdict(self._stats))  # asdict copies the requests dict too

    # ================================================================ engine thread
    def _on_cancel(self, handle: RequestHandle) -> None:
        with self._cv:
            if handle in self._waiting:  # never admitted: drop it now
                self._waiting.remove(handle)
                self._stats.queue_depth = len(self._waiting)
                waiting = True
            else:
                waiting = False
                self._cancel_pending = True
                self._cv.notify_all()
        if waiting:
            self._finish(handle, handle.cancel_reason or "cancelled")

    def _has_work_locked(self) -> bool:
        if self._closing or self._cancel_pending:
            return True
        return not self._paused and bool(self._waiting or self._active or self._prefilling)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._has_work_locked)
                if self._closing:
                    return
                self._cancel_pending = False
                admitted: list[RequestHandle] = []
                if not self._paused:
                    while self._waiting and self._num_active + len(admitted) < self.config.max_batch:
                        admitted.append(self._waiting.popleft())
                    self._num_active += len(admitted)  # slots are held from admission on
                    self._stats.queue_depth = len(self._waiting)
                paused = self._paused
            try:
                self._retire()
                if admitted:
                    self._admit(admitted)
                if paused:
                    pass
                elif self._prefilling and self._active and self.config.mix_prefill and not self.config.batch_invariant:
                    self._step(with_prefill=True)  # one pass: the batch's verify rows and a chunk of prompt
                else:
                    if self._prefilling:
                        self._prefill_chunk()
                    if self._active:
                        self._step()
            except Exception as err:  # noqa: BLE001 - a bug must fail requests, not hang them
                victims, self._active, self._prefilling = self._active + self._prefilling, [], []
                self._fail(victims, err)
                self._release_slots(len(victims))

    def _release_slots(self, count: int) -> None:
        with self._cv:
            self._num_active -= count
            self._stats.batch_size = len(self._active)

    def _fail(self, entries: list[_Active], err: Exception) -> None:
        """An internal error in prefill/step: fail those requests, keep serving the others."""
        log.error("engine error: %s\n%s", err, traceback.format_exc())
        for e in entries:
            e.cache.release()
            self._finish(e.handle, "error", f"{type(err).__name__}: {err}")

    def _admit(self, admitted: list[RequestHandle]) -> None:
        """Give each live admitted request its state and KV cache; prefill_chunk feeds their prompts."""
        live = [h for h in admitted if h.cancel_reason is None]
        for h in admitted:
            if h.cancel_reason is not None:
                self._finish(h, h.cancel_reason)
        self._release_slots(len(admitted) - len(live))
        block = max(self.drafter.block_size, 0)
        for h in live:
            s = h.sampling
            state = RequestState(h.request_id, len(h.prompt_ids), list(h.prompt_ids), s, s.make_generator())
            gen_room = min(s.max_new_tokens, _INITIAL_GEN_CAPACITY) + block + 2
            cache = self.target.new_cache(min(len(h.prompt_ids) + gen_room, self.target.max_context))
            hit = self._prefix.restore(h.prompt_ids, cache, want_features=bool(self.drafter.target_layer_ids))
            if hit is not None:  # the prefill starts after the restored prefix (its features too)
                state.context_features = hit.features
                with self._cv:
                    self._stats.cached_prompt_tokens += hit.length
            h.stats = AcceptanceStats(block_size=max(block, 1))
            self._prefilling.append(_Active(h, state, cache))

    def _prefill_pieces(self) -> PrefillPieces:
        """At most ``prefill_chunk`` prompt tokens of the prefilling requests, oldest request first.
        ``batch_invariant``: the oldest request's next piece alone, cut at multiples of ``prefill_chunk`` from its
        prompt's start, so that its pass (rows, product shapes) depends on the prompt only, never on the load."""
        budget = self.config.prefill_chunk or sum(len(e.state.tokens) for e in self._prefilling)
        if self.config.batch_invariant:
            e = self._prefilling[0]
            return PrefillPieces([e.state], [e.cache], [min(len(e.state.tokens) - e.cache.length, budget)])
        batch, counts = [], []
        for e in self._prefilling:
            if budget <= 0:
                break
            counts.append(min(len(e.state.tokens) - e.cache.length, budget))
            batch.append(e)
            budget -= counts[-1]
        return PrefillPieces([e.state for e in batch], [e.cache for e in batch], counts)

    def _prefill_chunk(self) -> None:
        """Feed one chunk of prompt in a pass of its own; completed prompts join the batch."""
        pieces = self._prefill_pieces()
        batch = self._prefilling[: len(pieces.counts)]
        t0 = time.perf_counter()
        try:
            complete = prefill(self.target, pieces.requests, pieces.caches, self.drafter.target_layer_ids,
                               pieces.counts)
        except Exception as err:  # noqa: BLE001 - one bad batch must not kill the server
            self._prefilling = self._prefilling[len(batch):]
            self._fail(batch, err)
            self._release_slots(len(batch))
            return
        elapsed = time.perf_counter() - t0
        self.step_times.add("prefill", sum(pieces.counts), elapsed)
        self._prefilled(batch, pieces.counts, complete, elapsed)

    def _prefilled(self, batch: list[_Active], counts: list[int], complete: list[bool], elapsed: float) -> None:
        """After a pass fed ``batch``'s pieces: completed prompts join the batch with their first token."""
        done = [e for e, c in zip(batch, complete) if c]
        self._prefilling = [e for e, c in zip(batch, complete) if not c] + self._prefilling[len(batch):]
        self._active.extend(done)
        with self._cv:
            self._stats.prefill_seconds += elapsed
            self._stats.prompt_tokens += sum(counts)
            self._stats.generation_tokens += len(done)
            self._stats.batch_size = len(self._active)
        for e in done:
            e.handle._emit(StreamEvent([e.state.tokens[-1]], e.state.finish_reason if e.state.finished else None))
            if e.state.finished:
                self._count(e.state.finish_reason)
        self._retire()

    def _step(self, with_prefill: bool = False) -> None:
        """One speculative step over the active batch; ``with_prefill``: a chunk of prompt in the same pass."""
        batch = self._active
        pieces = self._prefill_pieces() if with_prefill else None
        fed = self._prefilling[: len(pieces.counts)] if pieces is not None else []
        t0 = time.perf_counter()
        try:
            outcomes, timings = speculative_step(
                self.target, self.drafter, [a.state for a in batch], [a.cache for a in batch],
                self.policy, self.config.draft_cap, prefill=pieces,
            )
        except Exception as err:  # noqa: BLE001 - fail this batch, keep the server up
            self._prefilling = self._prefilling[len(fed):]
            self._fail(batch + fed, err)
            self._active = []
            self._release_slots(len(batch) + len(fed))
            return
        verified = accepted = committed = emitted = 0
        for a, o in zip(batch, outcomes):
            # a stop token inside the accepted drafts cuts the step short: count only the drafts kept
            # (speculative_step reports it so already; the clamp keeps the stats valid regardless)
            num_accepted = min(o.num_accepted, o.acceptance_length)
            a.handle.stats.add_step(o.proposal_len, num_accepted, o.acceptance_length)
            verified += o.proposal_len
            accepted += num_accepted
            committed += o.acceptance_length
            emitted += len(o.new_tokens)
            if o.new_tokens or a.state.finished:
                a.handle._emit(StreamEvent(list(o.new_tokens), a.state.finish_reason if a.state.finished else None))
            if a.state.finished:
                self._count(a.state.finish_reason)
        elapsed = time.perf_counter() - t0
        if pieces is None:
            self.step_times.add("verify", len(batch) + verified, elapsed)
        else:
            self.step_times.add("mixed", len(batch) + verified + sum(pieces.counts), elapsed)
        with self._cv:
            st = self._stats
            st.steps += 1
            st.drafted_steps += any(o.num_proposed for o in outcomes)
            st.request_steps += len(batch)
            st.verified_tokens += verified
            st.accepted_tokens += accepted
            st.committed_tokens += committed
            st.generation_tokens += emitted
            st.draft_seconds += timings.draft_s
            st.verify_seconds += timings.verify_s
        if pieces is not None:  # the pass's time is the step's (verify_seconds); the prompt tokens are counted here
            self._prefilled(fed, pieces.counts, timings.prefill_complete, 0.0)
        self._retire()

    def _retire(self) -> None:
        """Drop finished requests (their final event is out) and cancelled ones from the batch and the prefill list."""
        before = len(self._active) + len(self._prefilling)
        self._active, self._prefilling = self._live(self._active), self._live(self._prefilling)
        if len(self._active) + len(self._prefilling) < before:
            self._release_slots(before - len(self._active) - len(self._prefilling))

    def _live(self, entries: list[_Active]) -> list[_Active]:
        live = []
        for a in entries:
            if a.handle.cancel_reason is not None and not a.state.finished:
                self._finish(a.handle, a.handle.cancel_reason)
            if a.handle.cancel_reason is None and not a.state.finished:
                live.append(a)
            else:  # its slot of the target's KV pool: kept for its prompt's prefix, or free for the next admission
                self._prefix.keep(a.handle.prompt_ids, a.cache, a.state.context_features)
        return live

    def _finish(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        handle._emit(StreamEvent([], reason, error))
        self._count(reason)

    def _count(self, outcome: str) -> None:
        with self._cv:
            self._count_locked(outcome)

    def _count_locked(self, outcome: str) -> None:
        self._stats.requests[outcome] = self._stats.requests.get(outcome, 0) + 1
