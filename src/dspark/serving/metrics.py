"""Server metrics through ``prometheus_client``, with vLLM's names where vLLM has the metric.

Read from the engine at each scrape (``EngineCollector``):

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges), ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``;
* the ``dspark_*`` engine counters the load benchmark reads (steps, request-steps, verified / accepted /
  committed tokens, averages such as the acceptance length tau, requests by outcome, time by phase).

Observed by the server per request (``ServerMetrics``):

* histograms ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds`` (inter-token
  latency: a speculative step delivers several tokens at once, so each of them observes the gap since
  the previous step divided by their number), ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``;
* speculative-decoding counters, added from the request's AcceptanceStats when it ends:
  ``vllm:spec_decode_num_drafts`` (request-steps that verified at least one draft token),
  ``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens``,
  ``vllm:spec_decode_num_accepted_tokens_per_pos{position}`` (0-based draft position k) and
  ``dspark_spec_decode_num_draft_tokens_per_pos{position}`` (drafts verified at k), so that
  accepted_per_pos[k] / draft_tokens_per_pos[k] is the prefix acceptance ``accept_rate@k``
  (docs/interop.md §Evaluation protocol).

``parse_prometheus`` reads the text back (the load generator scrapes a server before and after a run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from dspark.generation.stats import AcceptanceStats
from dspark.serving.engine_stats import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# (name, type, help, value of EngineStats); counters are named without their _total suffix
_SCALARS = (
    ("dspark_engine_steps", "counter", "Speculative steps (target verify passes).", lambda s: s.steps),
    ("dspark_drafted_steps", "counter", "Steps whose drafter ran (async skips it where drafting does not pay).",
     lambda s: s.drafted_steps),
    ("dspark_request_steps", "counter", "Sum over steps of the number of requests in the batch.",
     lambda s: s.request_steps),
    ("dspark_verified_tokens", "counter", "Draft tokens sent to verification (sum of verify lengths l_r).",
     lambda s: s.verified_tokens),
    ("dspark_accepted_tokens", "counter", "Draft tokens accepted by rejection sampling.",
     lambda s: s.accepted_tokens),
    ("dspark_committed_tokens", "counter",
     "Tokens committed by speculative steps, bonus included (sum of acceptance lengths tau).",
     lambda s: s.committed_tokens),
    ("dspark_prompt_tokens", "counter", "Prompt tokens prefilled.", lambda s: s.prompt_tokens),
    ("dspark_prefix_cache_hit_tokens", "counter", "Prompt tokens restored from the prefix cache instead of prefilled.",
     lambda s: s.cached_prompt_tokens),
    ("dspark_generation_tokens", "counter", "Generated tokens streamed to clients.", lambda s: s.generation_tokens),
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
_FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "abort": "abort", "error": "abort"}

# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer steps below 10 ms for the inter-token latency
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


def _one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class EngineCollector:
    """The engine's counters and gauges, read at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model: str) -> None:
        self.stats, self.model = stats, model

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for name, kind, help_text, get in _SCALARS:
            make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = make(name, help_text, labels=["model"])
            family.add_metric([self.model], get(s))
            yield family
        outcomes = CounterMetricFamily("dspark_requests", "Requests by outcome (finish reason, or rejected when "
                                       "the queue was full).", labels=["model", "outcome"])
        for outcome in list(_OUTCOMES) + sorted(set(s.requests) - set(_OUTCOMES)):
            outcomes.add_metric([self.model, outcome], s.requests.get(outcome, 0))
        yield outcomes
        phases = CounterMetricFamily("dspark_step_seconds", "Engine time by phase.", labels=["model", "phase"])
        for phase, value in (("prefill", s.prefill_seconds), ("draft", s.draft_seconds),
                             ("verify", s.verify_seconds)):
            phases.add_metric([self.model, phase], value)
        yield phases
        # vLLM's names
        for name, help_text, value in (("vllm:num_requests_running", "Requests in the decoding batch.", s.batch_size),
                                       ("vllm:num_requests_waiting", "Requests waiting for a slot.", s.queue_depth)):
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            gauge.add_metric([self.model], value)
            yield gauge
        for name, help_text, value in (("vllm:prompt_tokens", "Prefilled prompt tokens.", s.prompt_tokens),
                                       ("vllm:generation_tokens", "Generated tokens.", s.generation_tokens)):
            counter = CounterMetricFamily(name, help_text, labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
        finished = {"stop": 0, "length": 0, "abort": 0}
        for outcome, count in s.requests.items():
            if outcome in _FINISHED:
                finished[_FINISHED[outcome]] += count
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in finished.items():
            success.add_metric([self.model, reason], count)
        yield success


class ServerMetrics:
    """One server's registry: the engine collector plus what the server observes per request."""

    def __init__(self, stats: Callable[[], EngineStats], model: str, max_context: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model))
        r, label = self.registry, ["model_name"]

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(name, help_text, label, buckets=buckets, registry=r).labels(model)

        def counter(name: str, help_text: str) -> Counter:
            return Counter(name, help_text, label, registry=r).labels(model)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to the first token.", _TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Inter-token latency: the gap between two steps over the tokens of the later.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _E2E_BUCKETS)
        token_buckets = _one_two_five(max_context)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per request "
                                           "(up to a stop string).", token_buckets)
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Request-steps that verified draft tokens.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.model = model
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at draft position k (0-based).",
                                        ["model_name", "position"], registry=r)
        self.drafted_per_pos = Counter("dspark_spec_decode_num_draft_tokens_per_pos",
                                       "Draft tokens verified at draft position k (0-based).",
                                       ["model_name", "position"], registry=r)

    def tokens(self, count: int, seconds: float) -> None:
        """``count`` tokens arrived ``seconds`` after the previous step's."""
        for _ in range(count):
            self.tpot.observe(seconds / count)

    def request_done(self, seconds: float, prompt_tokens: int, generation_tokens: int,
                     acceptance: AcceptanceStats | None) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        if acceptance is None:
            return
        counts = [list(row) for row in acceptance.counts]  # counts[p][a]: steps verifying p drafts, accepting a
        self.num_drafts.inc(sum(sum(row) for row in counts[1:]))
        self.num_draft_tokens.inc(sum(p * sum(row) for p, row in enumerate(counts)))
        self.num_accepted.inc(sum(a * c for row in counts for a, c in enumerate(row)))
        for k in range(acceptance.block_size):
            drafted = sum(sum(row) for row in counts[k + 1 :])
            if drafted:
                accepted = sum(c for row in counts[k + 1 :] for c in row[k + 1 :])
                self.drafted_per_pos.labels(self.model, str(k)).inc(drafted)
                self.accepted_per_pos.labels(self.model, str(k)).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted (label, value) pairs): value}; raises ValueError on text that is not Prometheus."""
    samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    except (ValueError, IndexError, KeyError) as err:
        raise ValueError(f"not Prometheus text: {err}") from None
    return samples


def metric_sum(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, pairs), v in samples.items()
               if n == name and all((k, val) in pairs for k, val in labels.items()))
