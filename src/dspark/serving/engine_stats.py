"""What the engine counts: totals since start (``EngineStats``) and pass times by batch tokens (``StepTimes``)."""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import asdict, dataclass, field

from dspark.scheduler.sps import SPSTable


@dataclass
class EngineStats:
    """Counters since start plus the current batch; ``snapshot`` copies them under the lock."""

    steps: int = 0  # speculative steps (one target verify pass each)
    drafted_steps: int = 0  # steps whose drafter ran (``async`` skips it where drafting does not pay)
    request_steps: int = 0  # sum over steps of the batch size
    verified_tokens: int = 0  # draft tokens sent to verification, sum of l_r
    accepted_tokens: int = 0  # draft tokens accepted
    committed_tokens: int = 0  # sum of acceptance lengths tau (bonus included)
    prompt_tokens: int = 0  # prompt tokens prefilled
    cached_prompt_tokens: int = 0  # prompt tokens restored from the prefix cache instead
    generation_tokens: int = 0  # tokens streamed to clients (first tokens included)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)  # outcome -> count ("stop", "rejected", ...)
    batch_size: int = 0  # active requests now
    queue_depth: int = 0  # waiting requests now
    max_batch: int = 0
    max_queue: int = 0

    @property
    def avg_acceptance_length(self) -> float:
        """tau: committed tokens per request-step, bonus included."""
        return self.committed_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def avg_verify_len(self) -> float:
        """Mean l_r: draft tokens verified per request-step (the target checks 1 + l_r)."""
        return self.verified_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def avg_batch_size(self) -> float:
        return self.request_steps / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(avg_acceptance_length=self.avg_acceptance_length, avg_verify_len=self.avg_verify_len,
                 avg_batch_size=self.avg_batch_size)
        return d


class StepTimes:
    """Wall seconds of the engine's passes by batch tokens: the SPS table of the machine as the real load saw it.

    ``verify``: one engine step (draft + policy + verify pass + host work) keyed by its batch tokens
    B = sum_r (1 + l_r) (paper §3.2.2); ``prefill``: one chunked-prefill pass keyed by its prompt tokens;
    ``mixed``: a step that fed a chunk of prompt in its pass, keyed by B + the chunk's tokens. The
    newest ``keep`` durations per key are kept, so a long-running server holds bounded memory. ``table`` turns
    them into an SGLang-format ``SPSTable`` (1 / median seconds per observed B), which ``dspark simulate`` and
    the verify policies read like a profiled one (docs/serving/simulator-validation.md).
    """

    KINDS = ("verify", "prefill", "mixed")

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._times: dict[str, dict[int, deque]] = {k: {} for k in self.KINDS}

    def add(self, kind: str, batch_tokens: int, seconds: float) -> None:
        with self._lock:
            self._times[kind].setdefault(int(batch_tokens), deque(maxlen=self.keep)).append(float(seconds))

    def clear(self) -> None:
        with self._lock:
            self._times = {k: {} for k in self.KINDS}

    def merge(self, other: StepTimes) -> None:
        for kind, by_tokens in other.snapshot().items():
            for b, times in by_tokens.items():
                for t in times:
                    self.add(kind, b, t)

    def snapshot(self) -> dict[str, dict[int, list[float]]]:
        with self._lock:
            return {k: {b: list(ts) for b, ts in sorted(v.items())} for k, v in self._times.items()}

    def summary(self) -> dict[str, dict[str, list[float]]]:
        """kind -> {B: [passes, median seconds]} (JSON keys are strings)."""
        return {k: {str(b): [len(ts), statistics.median(ts)] for b, ts in v.items()}
                for k, v in self.snapshot().items()}

    def table(self, kind: str = "verify", min_passes: int = 1, max_batch_tokens: int | None = None) -> SPSTable | None:
        """1 / median seconds at every B seen at least ``min_passes`` times; None when none was.
        ``max_batch_tokens`` defaults to twice the largest B seen (beyond it the table holds its last value)."""
        rows = [(b, statistics.median(ts)) for b, ts in self.snapshot()[kind].items() if len(ts) >= min_passes]
        if not rows:
            return None
        return SPSTable(tuple(b for b, _ in rows), tuple(1.0 / max(t, 1e-9) for _, t in rows),
                        max_batch_tokens or 2 * rows[-1][0])
