"""Closed-loop load generator and the serving benchmark (paper Figs. 7 and 8).

For each verify policy the sweep starts an in-process server (engine +
uvicorn on 127.0.0.1, a free port), then for each concurrency c runs c
closed-loop clients over real HTTP: each client sends a streaming chat
request, waits for the answer, sends the next, until ``num_requests`` requests
are done or ``time_limit_s`` has passed. Per (policy, concurrency) it reports

* ``total_tokens_per_s``: completion tokens of all requests / wall time,
* ``user_tokens_per_s``: mean over requests of completion tokens / latency,
* ``avg_verify_len`` (draft tokens verified per request-step) and
  ``acceptance_length`` (tau per request-step), from the server's /metrics
  counters scraped before and after the run,

and writes JSON, a Markdown table and the two figures, plus the SPS tables the run itself saw
(``observed_verify_sps.json``, ``observed_prefill_sps.json``: 1 / median wall seconds of the engine's steps
and prefill chunks at each batch-token count, pooled over the measured points; ``StepTimes``), which
``dspark simulate`` can replay under the same machine conditions. ``run_point`` also
works against any running dspark server (``--url``), or a vLLM one (its
``vllm:spec_decode_*`` counters; there a step with drafts counts one bonus token).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from dspark.data.eval_sets import find_eval_dir
from dspark.serving.metrics import metric_sum, parse_prometheus
from dspark.tables import Column, fmt, records_table

EVAL_SETS = ("gsm8k", "mt-bench", "humaneval", "math500", "mbpp", "arena-hard-v2", "livecodebench", "aime25")


# =============================================================== prompts
def _first_turn(line: str, where: str) -> str:
    record = json.loads(line)
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    raise ValueError(f"{where}: expected {{\"turns\": [...]}} or {{\"prompt\": ...}} records")


def load_prompts(path: str | Path | None = None, limit: int = 256) -> list[str]:
    """First turns of a ``{"turns": [...]}`` JSONL, or a round-robin mix of the evaluation sets."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"prompt file {path} does not exist")
        lines = [ln for ln in path.read_text(encoding="utf-8").split("\n") if ln.strip()]
        prompts = [_first_turn(ln, f"{path}:{i + 1}") for i, ln in enumerate(lines[:limit])]
        if not prompts:
            raise ValueError(f"prompt file {path} has no prompts")
        return prompts
    folder = find_eval_dir()
    per_set = []
    for name in EVAL_SETS:
        f = folder / f"{name}.jsonl"
        if f.is_file():
            lines = [ln for ln in f.read_text(encoding="utf-8").split("\n") if ln.strip()][:limit]
            per_set.append([_first_turn(ln, str(f)) for ln in lines])
    prompts = [p for group in zip(*per_set) for p in group] if per_set else []
    if not prompts:
        raise ValueError(f"no prompts in {folder}")
    return prompts[:limit]


# =============================================================== one load point
@dataclass
class RequestRecord:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None


async def _chat_request(client: httpx.AsyncClient, model: str | None, prompt: str, max_tokens: int,
                        temperature: float, seed: int) -> RequestRecord:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestRecord(False, time.perf_counter() - start, error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestRecord(False, time.perf_counter() - start, error=str(chunk["error"]))
                if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as err:
        return RequestRecord(False, time.perf_counter() - start, error=f"{type(err).__name__}: {err}")
    return RequestRecord(True, time.perf_counter() - start, ttft, tokens)


async def closed_loop(base_url: str, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int,
                      temperature: float = 1.0, model: str | None = None, api_key: str | None = None,
                      time_limit_s: float = 300.0, seed: int = 0) -> tuple[list[RequestRecord], float]:
    """``concurrency`` clients, each sending its next request when the previous one is answered."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    counter = iter(range(num_requests))
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + time_limit_s
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        async def worker() -> None:
            for i in counter:
                if time.perf_counter() > deadline:
                    return
                records.append(await _chat_request(client, model, prompts[i % len(prompts)], max_tokens,
                                                   temperature, seed + i))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def scrape_metrics(base_url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30)
    resp.raise_for_status()
    return parse_prometheus(resp.text)


def run_point(base_url: str, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int,
              temperature: float = 1.0, policy: str = "server", model: str | None = None,
              api_key: str | None = None, time_limit_s: float = 300.0, seed: int = 0) -> dict:
    """One (policy, concurrency) measurement against a running server; returns a result row."""
    before = scrape_metrics(base_url, api_key)
    records, wall = asyncio.run(closed_loop(base_url, prompts, concurrency, num_requests, max_tokens,
                                            temperature, model, api_key, time_limit_s, seed))
    after = scrape_metrics(base_url, api_key)

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    ok = [r for r in records if r.ok]
    request_steps = delta("dspark_request_steps_total")
    steps = delta("dspark_engine_steps_total")
    verified, committed = delta("dspark_verified_tokens_total"), delta("dspark_committed_tokens_total")
    if not any(name == "dspark_request_steps_total" for name, _ in after):  # a vLLM server: its spec-decode counters
        request_steps = delta("vllm:spec_decode_num_drafts_total")
        verified = delta("vllm:spec_decode_num_draft_tokens_total")
        committed = request_steps + delta("vllm:spec_decode_num_accepted_tokens_total")  # + 1 bonus per draft
    drafted = delta("dspark_drafted_steps_total")
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "policy": policy,
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if not r.ok), None),
        "wall_s": wall,
        "completion_tokens": tokens,
        "total_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "user_tokens_per_s": statistics.fmean(r.completion_tokens / r.latency_s for r in ok) if ok else 0.0,
        "mean_latency_s": statistics.fmean(r.latency_s for r in ok) if ok else None,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "avg_verify_len": verified / request_steps if request_steps else None,
        "acceptance_length": committed / request_steps if request_steps else None,
        "avg_batch_size": request_steps / steps if steps else None,
        # the engine's own timings (dspark only): the drafter's time per step that drafted; the verify pass and the
        # host work around it per step (prompt pieces that ride in the pass included)
        "draft_ms": 1000 * delta("dspark_step_seconds_total", phase="draft") / drafted if drafted else None,
        "verify_ms": 1000 * delta("dspark_step_seconds_total", phase="verify") / steps if steps else None,
    }


# =============================================================== the sweep
@dataclass
class SweepConfig:
    target: str = "smollm2-135m"
    device: str = "cpu"  # cpu | cuda: target and drafter
    dtype: str = "float32"
    compile: bool = False
    drafter: str = "prompt-lookup"
    policies: list[str] = field(default_factory=lambda: ["fixed:1", "alg1", "async", "all"])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_requests: int = 16  # per point, at least the concurrency
    max_tokens: int = 64
    temperature: float = 1.0
    prompts: str | None = None
    block_size: int | None = None
    head_top_m: int | None = None
    draft_vocab: str | None = None
    sps_table: str | None = None  # a step-cost model or an SPS table (StepCostModel.load reads both)
    profile_step_cost: str | None = None  # profile the whole step at start and save the model here
    sts: str | None = None
    fallback_confidence: float = 1.0
    time_limit_s: float = 300.0
    seed: int = 0
    url: str | None = None  # measure a running server instead (policy label "server")
    api_key: str | None = None


def run_sweep(cfg: SweepConfig, log=print) -> tuple[list[dict], dict]:
    """All (policy, concurrency) points; returns (rows, metadata)."""
    prompts = load_prompts(cfg.prompts, limit=max(cfg.num_requests, max(cfg.concurrency)) * 4)
    meta = {"config": asdict(cfg), "python": sys.version.split()[0], "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "num_prompts": len(prompts)}
    rows: list[dict] = []

    def sweep(url: str, policy: str) -> None:
        for c in cfg.concurrency:
            n = max(cfg.num_requests, c)
            row = run_point(url, prompts, c, n, cfg.max_tokens, cfg.temperature, policy,
                            api_key=cfg.api_key, time_limit_s=cfg.time_limit_s, seed=cfg.seed)
            log(f"  {policy:>12} c={c:<3} {row['total_tokens_per_s']:8.1f} tok/s total, "
                f"{row['user_tokens_per_s']:7.1f} tok/s/user, verify {row['avg_verify_len'] or 0:.2f}, "
                f"tau {row['acceptance_length'] or 0:.2f}, errors {row['errors']}")
            rows.append(row)

    if cfg.url:
        sweep(cfg.url.rstrip("/"), "server")
        return rows, meta

    import torch

    from dspark.drafters.options import DraftingOptions
    from dspark.drafters.registry import load_drafter
    from dspark.scheduler.adapter import make_policy, parse_policy
    from dspark.generation.step_profile import load_or_profile_cost
    from dspark.scheduler.sts import load_sts_json
    from dspark.serving.engine import Engine, EngineConfig
    from dspark.serving.engine_stats import StepTimes
    from dspark.serving.server import ServerConfig, ServerThread, create_app
    from dspark.target.loading import torch_dtype
    from dspark.target.model import load_target

    specs = [parse_policy(p) for p in cfg.policies]  # fail early on a typo
    target = load_target(cfg.target, dtype=torch_dtype(cfg.dtype), fuse=True, device=cfg.device,
                         batch_invariant=True, pack=not cfg.compile)
    if cfg.compile:
        from dspark.modeling.compile import compile_decoder

        compile_decoder(target.model)
    drafter = load_drafter(cfg.drafter, target, DraftingOptions(block_size=cfg.block_size, head_top_m=cfg.head_top_m, draft_vocab=cfg.draft_vocab))
    sps = None
    if any(s.needs_sps_table for s in specs):
        sps = load_or_profile_cost(cfg.sps_table, target, drafter, max(cfg.concurrency), cfg.profile_step_cost,
                                   cfg.drafter, log=log)
        meta["sps_table"] = sps.to_dict()
    temps = load_sts_json(cfg.sts, drafter.block_size) if cfg.sts else None
    meta.update(torch=torch.__version__, torch_threads=torch.get_num_threads(), block_size=drafter.block_size)
    observed = StepTimes()  # every measured pass of every policy: the SPS tables this run saw
    for name in cfg.policies:
        policy = make_policy(name, sps, temps, cfg.fallback_confidence)
        engine = Engine(target, drafter, policy,
                        EngineConfig(max_batch=max(cfg.concurrency), max_queue=max(cfg.concurrency)))
        app = create_app(engine, target.tokenizer, ServerConfig(model_name=cfg.target, api_key=cfg.api_key))
        log(f"[dspark] policy {name}")
        with ServerThread(app) as server:
            asyncio.run(closed_loop(server.url, prompts, 1, 1, min(8, cfg.max_tokens), cfg.temperature,
                                    api_key=cfg.api_key))  # warm-up, not measured
            engine.step_times.clear()
            sweep(server.url, name)
        observed.merge(engine.step_times)
    meta["observed_step_times"] = observed.summary()
    for kind in StepTimes.KINDS:
        table = observed.table(kind)
        meta[f"observed_{kind}_sps"] = table.to_dict() if table else None
    return rows, meta


# =============================================================== report
# (column title, row -> cell text) of serve_load.md
COLUMNS: list[Column] = [
    ("policy", lambda r: r["policy"]),
    ("concurrency", lambda r: str(r["concurrency"])),
    ("requests", lambda r: str(r["requests"])),
    ("total tok/s", lambda r: fmt(r["total_tokens_per_s"], 1)),
    ("per-user tok/s", lambda r: fmt(r["user_tokens_per_s"], 1)),
    ("mean latency s", lambda r: fmt(r["mean_latency_s"])),
    ("verify len", lambda r: fmt(r["avg_verify_len"])),
    ("tau", lambda r: fmt(r["acceptance_length"])),
    ("batch", lambda r: fmt(r["avg_batch_size"])),
    ("errors", lambda r: str(r["errors"])),
]


def write_report(rows: list[dict], meta: dict, out_dir: str | Path, command: str = "") -> list[Path]:
    """serve_load.json, serve_load.md, throughput_vs_user_speed.png (Fig. 7), verify_budget.png (Fig. 8)."""
    from dspark.evaluation.plots import plot_throughput_vs_user_speed, plot_verify_budget

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "serve_load.json", out / "serve_load.md"]
    paths[0].write_text(json.dumps({"command": command, "meta": meta, "rows": rows}, indent=2) + "\n")
    cfg = meta.get("config", {})
    lines = [
        "# Serving load benchmark", "",
        f"Reproduce: `{command}`" if command else "",
        "",
        f"Target `{cfg.get('target')}`, drafter `{cfg.get('drafter')}`, {cfg.get('max_tokens')} max tokens, "
        f"temperature {cfg.get('temperature')}, {meta.get('cpu_count')} CPUs ({meta.get('platform')}). "
        "Closed-loop clients over HTTP on 127.0.0.1; verify length = draft tokens verified per request-step, "
        "tau = tokens committed per request-step (bonus included).",
        "",
        *records_table(COLUMNS, rows),
    ]
    paths[1].write_text("\n".join(lines) + "\n")
    for kind in ("verify", "prefill"):  # the step times this run saw, as SPS tables (`dspark simulate` reads them)
        if meta.get(f"observed_{kind}_sps"):
            paths.append(out / f"observed_{kind}_sps.json")
            paths[-1].write_text(json.dumps(meta[f"observed_{kind}_sps"], indent=1) + "\n")
    plotted = [r for r in rows if r["requests"]]
    if plotted:
        paths.append(plot_throughput_vs_user_speed(plotted, out / "throughput_vs_user_speed.png"))
        budget = [r for r in plotted if r["avg_verify_len"] is not None]
        if budget:
            paths.append(plot_verify_budget(budget, out / "verify_budget.png"))
    return paths
