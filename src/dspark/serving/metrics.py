"""Engine statistics as Prometheus text (exposition format 0.0.4), and a reader for it.

``render_prometheus`` is what ``GET /metrics`` returns; ``parse_prometheus``
reads it back (the load generator scrapes a server before and after a run and
takes differences of the counters).
"""

from __future__ import annotations

import math
import re

from dspark.serving.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, value of EngineStats)
_SCALARS = (
    ("dspark_engine_steps_total", "counter", "Speculative steps (target verify passes).", lambda s: s.steps),
    ("dspark_request_steps_total", "counter", "Sum over steps of the number of requests in the batch.",
     lambda s: s.request_steps),
    ("dspark_verified_tokens_total", "counter", "Draft tokens sent to verification (sum of verify lengths l_r).",
     lambda s: s.verified_tokens),
    ("dspark_accepted_tokens_total", "counter", "Draft tokens accepted by rejection sampling.",
     lambda s: s.accepted_tokens),
    ("dspark_committed_tokens_total", "counter",
     "Tokens committed by speculative steps, bonus included (sum of acceptance lengths tau).",
     lambda s: s.committed_tokens),
    ("dspark_prompt_tokens_total", "counter", "Prompt tokens prefilled.", lambda s: s.prompt_tokens),
    ("dspark_generation_tokens_total", "counter", "Generated tokens streamed to clients.",
     lambda s: s.generation_tokens),
    ("dspark_acceptance_length", "gauge", "Average acceptance length tau per request-step since start.",
     lambda s: s.avg_acceptance_length),
    ("dspark_verify_length", "gauge", "Average draft tokens verified per request-step since start.",
     lambda s: s.avg_verify_len),
    ("dspark_avg_batch_size", "gauge", "Average requests per step since start.", lambda s: s.avg_batch_size),
    ("dspark_batch_size", "gauge", "Requests in the active batch now.", lambda s: s.batch_size),
    ("dspark_queue_depth", "gauge", "Requests waiting for a slot now.", lambda s: s.queue_depth),
    ("dspark_max_batch", "gauge", "Configured maximum active requests.", lambda s: s.max_batch),
    ("dspark_max_queue", "gauge", "Configured maximum waiting requests.", lambda s: s.max_queue),
)

_OUTCOMES = ("stop", "length", "cancelled", "abort", "error", "rejected")


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def render_prometheus(stats: EngineStats, model: str = "") -> str:
    """Prometheus text for one engine; every sample carries a ``model`` label."""
    label = f'model="{_escape(model)}"'
    lines: list[str] = []
    for name, kind, help_text, get in _SCALARS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {_fmt(get(stats))}"]
    name = "dspark_requests_total"
    lines += [f"# HELP {name} Requests by outcome (finish reason, or rejected when the queue was full).",
              f"# TYPE {name} counter"]
    outcomes = list(_OUTCOMES) + sorted(set(stats.requests) - set(_OUTCOMES))
    for outcome in outcomes:
        lines.append(f'{name}{{{label},outcome="{_escape(outcome)}"}} {stats.requests.get(outcome, 0)}')
    name = "dspark_step_seconds_total"
    lines += [f"# HELP {name} Engine time by phase.", f"# TYPE {name} counter"]
    for phase, value in (("prefill", stats.prefill_seconds), ("draft", stats.draft_seconds),
                         ("verify", stats.verify_seconds)):
        lines.append(f'{name}{{{label},phase="{phase}"}} {_fmt(value)}')
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(metric name, sorted (label, value) pairs): value}; raises ValueError on a malformed line."""
    samples = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise ValueError(f"line {number} is not a Prometheus sample: {line!r}")
        name, labels, value = match.groups()
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        samples[(name, pairs)] = float(value)
    return samples


def metric_sum(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, pairs), v in samples.items()
               if n == name and all((k, val) in pairs for k, val in labels.items()))
