"""`dspark bench chaos --soak N`: N mixed requests against a `dspark serve` process on 127.0.0.1, its RSS
sampled, then SIGTERM with streams in flight. Written into docs/reports/reliability.md (its "Soak" section).

The server runs in its own process so its resident memory is its own (the load generator's threads and
buffers are not counted). The requests are small (a few tokens each) and mixed the way a day of traffic
mixes them, from one seeded ``random.Random``:

- kinds: short completions, chat, medium prompts (60-150 words), a few long ones (400-600 words),
  streams the client drops after the first event (cancellation), and malformed or refused bodies;
- streaming or not, greedy or seeded sampling, stop strings or not;
- concurrency changing every ``block`` requests: 1, 8, 4, 16 clients in turn.

RSS (``VmRSS`` of /proc/PID/status) is read before the first request and after every block; the page
reports it at 1k, 2k, ... requests and the ratio last / first-thousand (goal: within 10 %).
Then, with ``shutdown_streams`` streams running, SIGTERM: how long the process takes to exit, its exit
status, and whether every stream ended with a terminal event (a finish_reason or an error, then [DONE]).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from dspark.tables import fmt

WORDS = ("the a of and to in is was for on that with as by at from it his an were are which this be or had not "
         "but one all they she there been have their her has when who will more no if out so said what up its "
         "about into than them can only other new some time could these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good very make world "
         "still own see men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three").split()
CONCURRENCY = (1, 8, 4, 16)
KINDS = {"short": 42, "chat": 25, "medium": 6, "long": 1, "cancel": 12, "bad": 14}
BAD_BODIES = [
    ("completions", b'{"prompt": "hi"'), ("completions", b'{"prompt": "hi", "max_tokens": 0}'),
    ("completions", b'{"prompt": "hi", "stop": ["' + b"q" * 5000 + b'"]}'),
    ("completions", b'{"prompt": "hi", "logprobs": 3}'), ("completions", b'{"prompt": [1, -5]}'),
    ("completions", b'{"prompt": "abc\\ud800"}'), ("completions", b'{"prompt": "hi", "temperature": "hot"}'),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": 1}}'),
    ("chat/completions", b'{"messages": []}'), ("chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
]


@dataclass
class SoakConfig:
    target: str = "smollm2-135m"
    drafter: str = "prompt-lookup"
    requests: int = 5000
    block: int = 100  # requests per concurrency level; RSS is read after each block
    max_batch: int = 8
    threads: int = 1
    seed: int = 0
    shutdown_streams: int = 8
    shutdown_timeout_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024  # the server's default (serving.limits.DEFAULT_MAX_BODY_BYTES)
    serve_args: list[str] = field(default_factory=list)  # extra `dspark serve` flags
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the server process
    progress_path: str | None = None  # the samples so far, rewritten after every block


def _own_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def process_rss_mib(pid: int) -> dict[int, float]:
    """VmRSS of ``pid`` and of its descendants (the server and its engine core), by process id."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            out[p] = _own_rss_mib(p)
            todo += _children(p)
        except (OSError, RuntimeError):  # it exited meanwhile
            pass
    return out


def rss_mib(pid: int) -> float:
    """The server's resident memory: its own plus its children's (the engine core runs in one)."""
    return sum(process_rss_mib(pid).values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cfg: SoakConfig, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    src = str(Path(__file__).resolve().parents[2])  # the dspark package this bench runs from
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads),
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), **cfg.env}
    cmd = [sys.executable, "-m", "dspark.cli", "--threads", str(cfg.threads), "serve", "--target", cfg.target,
           "--drafter", cfg.drafter, "--port", str(port), "--max-batch", str(cfg.max_batch), "--max-queue", "64",
           "--shutdown-timeout", str(cfg.shutdown_timeout_s), "--log-level", "warning", *cfg.serve_args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"dspark serve did not start; see {log_path}")
        time.sleep(0.5)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def plan(cfg: SoakConfig) -> list[dict]:
    """The requests, in order: {"kind", "path", "body" (dict or bytes), "stream"}."""
    rng = random.Random(cfg.seed)
    kinds, weights = zip(*KINDS.items())
    out = []
    for _ in range(cfg.requests):
        kind = rng.choices(kinds, weights)[0]
        stream = rng.random() < 0.5
        sampling = {"temperature": 0} if rng.random() < 0.5 else {"temperature": 1.0, "seed": rng.randrange(10**6)}
        if kind == "bad":
            path, body = rng.choice(BAD_BODIES)
            out.append({"kind": kind, "path": path, "body": body, "stream": False})
            continue
        if kind == "chat":
            body = {"messages": [{"role": "user", "content": _text(rng, rng.randint(3, 30))}]}
            path = "chat/completions"
        else:
            words = {"short": (3, 20), "cancel": (3, 20), "medium": (60, 150), "long": (400, 600)}[kind]
            body, path = {"prompt": _text(rng, rng.randint(*words))}, "completions"
        body.update(sampling, max_tokens=64 if kind == "cancel" else rng.randint(1, 6))
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(WORDS), _text(rng, 2)]
        if kind == "cancel":
            stream = True
        body["stream"] = stream
        out.append({"kind": kind, "path": path, "body": body, "stream": stream})
    return out


def send(client: httpx.Client, url: str, req: dict) -> str:
    """The outcome: "ok", "4xx", "cancelled", or what went wrong ("5xx", "transport", "no [DONE]", ...)."""
    target = f"{url}/v1/{req['path']}"
    try:
        if req["kind"] == "bad":
            resp = client.post(target, content=req["body"], headers={"Content-Type": "application/json"})
            return "4xx" if 400 <= resp.status_code < 500 else f"{resp.status_code} (bad body)"
        if not req["stream"]:
            resp = client.post(target, json=req["body"])
            if resp.status_code >= 500:
                return "5xx"
            return "ok" if resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] else "bad answer"
        with client.stream("POST", target, json=req["body"]) as resp:
            if resp.status_code != 200:
                return "5xx" if resp.status_code >= 500 else f"{resp.status_code}"
            last = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    if req["kind"] == "cancel":
                        return "cancelled"  # leaving the block closes the connection mid-stream
                    last = (last + [line[6:]])[-2:]
            return "ok" if last and last[-1] == "[DONE]" and "error" not in json.loads(last[0]) else "no [DONE]"
    except httpx.HTTPError as err:
        return f"transport ({type(err).__name__})"


class HealthWatch:
    """Polls /health every ``every`` seconds in a thread; ``worst()`` is the slowest answer since the last call."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        self.url, self.every = url, every
        self._worst, self._failures = 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self._worst = max(self._worst, time.perf_counter() - t0)
                self._failures += not ok
                self._stop.wait(self.every)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def worst(self) -> tuple[float, int]:
        worst, failures = self._worst, self._failures
        self._worst, self._failures = 0.0, 0
        return worst, failures


def heavy_inputs(max_body: int) -> list[tuple[str, str, dict]]:
    """(name, path, body) of the requests that cost the most per byte: each must leave /health answering."""
    big = max_body - 4096
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ("text prompt near the body limit", "completions", {"prompt": "word " * (big // 5), "max_tokens": 2}),
        ("chat message near the body limit", "chat/completions",
         {"messages": [{"role": "user", "content": "a b " * (big // 4)}], "max_tokens": 2}),
        ("100,000 one-word messages", "chat/completions",
         {"messages": [{"role": "user", "content": "a"}] * 100_000, "max_tokens": 2}),
        ("token-id prompt near the body limit", "completions", {"prompt": [7] * (big // 3), "max_tokens": 2}),
        ("a 1,000,000-character stop string", "completions", {"prompt": "hi", "stop": ["q" * 1_000_000]}),
        ("16 stop strings of 2,048 characters", "completions",
         {"prompt": "hi", "max_tokens": 4, "stop": ["q" * 2047 + str(i % 10) for i in range(16)]}),
        ("100,000 stop_token_ids", "completions", {"prompt": "hi", "stop_token_ids": [3] * 100_000}),
        ("logit_bias with 200,000 entries", "completions",
         {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(200_000)}}),
        ("chat_template_kwargs.messages", "chat/completions", {**chat, "chat_template_kwargs": {"messages": 1}}),
        ("20,000 chat_template_kwargs", "chat/completions",
         {**chat, "chat_template_kwargs": {f"k{i}": i for i in range(20_000)}}),
    ]


def run_heavy(url: str, max_body: int) -> list[dict]:
    rows = []
    with httpx.Client(timeout=600) as client:
        for name, path, body in heavy_inputs(max_body):
            raw = json.dumps(body).encode()
            with HealthWatch(url, every=0.05) as watch:
                time.sleep(0.1)
                t0 = time.perf_counter()
                resp = client.post(f"{url}/v1/{path}", content=raw, headers={"Content-Type": "application/json"})
                seconds = time.perf_counter() - t0
                time.sleep(0.1)
            worst, failures = watch.worst()
            rows.append({"name": name, "bytes": len(raw), "status": resp.status_code, "seconds": seconds,
                         "health_worst_s": worst, "health_failures": failures})
    return rows


def run_load(url: str, requests: list[dict], cfg: SoakConfig, pid: int, log=print) -> tuple[list[dict], dict]:
    samples = [{"requests": 0, "rss_mib": rss_mib(pid), "seconds": 0.0}]
    log(f"[soak] RSS at start {samples[0]['rss_mib']:.0f} MiB")
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    t0 = time.perf_counter()
    local = threading.local()

    def one(req: dict) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=600)
        outcome = send(local.client, url, req)
        with lock:
            key = f"{req['kind']}: {outcome}"
            outcomes[key] = outcomes.get(key, 0) + 1

    watch = HealthWatch(url).__enter__()
    for b, start in enumerate(range(0, len(requests), cfg.block)):
        with ThreadPoolExecutor(CONCURRENCY[b % len(CONCURRENCY)]) as pool:
            list(pool.map(one, requests[start : start + cfg.block]))
        done = min(start + cfg.block, len(requests))
        worst, failures = watch.worst()
        by_process = process_rss_mib(pid)
        samples.append({"requests": done, "rss_mib": sum(by_process.values()), "rss_by_process": by_process,
                        "seconds": time.perf_counter() - t0,
                        "health_worst_s": worst, "health_failures": failures})
        if cfg.progress_path:  # a run stopped early still leaves its samples
            Path(cfg.progress_path).write_text(json.dumps({"samples": samples, "outcomes": outcomes}))
        if done % 200 == 0 or done == len(requests):
            log(f"[soak] {done} requests, {samples[-1]['seconds']:.0f} s, RSS {samples[-1]['rss_mib']:.0f} MiB")
    watch.__exit__(None, None, None)
    time.sleep(5)
    samples.append({"requests": len(requests), "rss_mib": rss_mib(pid), "seconds": time.perf_counter() - t0,
                    "idle": True})
    return samples, outcomes


def run_shutdown(proc: subprocess.Popen, url: str, cfg: SoakConfig) -> dict:
    """SIGTERM with ``shutdown_streams`` long streams running: exit time, status, terminal events."""
    ends: list[str] = []
    started = threading.Semaphore(0)
    lock = threading.Lock()

    def stream(i: int) -> None:
        body = {"prompt": f"Tell story number {i}, slowly:", "max_tokens": 2000, "temperature": 0, "stream": True}
        last, first = [], True
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        if first:
                            started.release()
                            first = False
                        last = (last + [line[6:]])[-2:]
            if last and last[-1] == "[DONE]":
                end = "error event" if "error" in json.loads(last[0]) else "finished"
            else:
                end = "cut"
        except httpx.HTTPError:
            end = "cut"
        if first:
            started.release()
        with lock:
            ends.append(end)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(cfg.shutdown_streams)]
    for t in threads:
        t.start()
    for _ in range(min(cfg.shutdown_streams, cfg.max_batch)):
        started.acquire(timeout=300)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(cfg.shutdown_timeout_s + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed"
    exit_s = time.perf_counter() - t0
    for t in threads:
        t.join(60)
    return {"streams": cfg.shutdown_streams, "exit_s": exit_s, "returncode": rc,
            "ends": {e: ends.count(e) for e in sorted(set(ends))}, "timeout_s": cfg.shutdown_timeout_s}


def run_soak(cfg: SoakConfig, log_path: Path, log=print) -> dict:
    requests = plan(cfg)
    log(f"[soak] starting dspark serve --target {cfg.target} --drafter {cfg.drafter}")
    proc, url = start_server(cfg, log_path)
    try:
        log("[soak] heavy inputs")
        heavy = run_heavy(url, cfg.max_body_bytes)
        samples, outcomes = run_load(url, requests, cfg, proc.pid, log)
        log("[soak] SIGTERM with streams in flight")
        shutdown = run_shutdown(proc, url, cfg)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    return {"config": asdict(cfg), "samples": samples, "outcomes": outcomes, "shutdown": shutdown, "heavy": heavy,
            "tracebacks": text.count("Traceback"), "cancelled_errors": text.count("CancelledError"),
            "kinds": {k: sum(r["kind"] == k for r in requests) for k in KINDS},
            "streams": sum(r["stream"] for r in requests)}


# =============================================================== the page section
BEGIN, END = "<!-- soak: written by dspark bench chaos --soak -->", "<!-- /soak -->"


def _at(samples: list[dict], n: int) -> float | None:
    hits = [s["rss_mib"] for s in samples if s["requests"] == n and not s.get("idle")]
    return hits[0] if hits else None


def render_soak(result: dict, command: str) -> str:
    cfg, samples, sd = result["config"], result["samples"], result["shutdown"]
    n = cfg["requests"]
    marks = [k for k in range(1000, n + 1, 1000)] or [n]
    rss1k, rss_end = _at(samples, marks[0]), _at(samples, n)
    bad = {k: v for k, v in result["outcomes"].items() if not k.endswith((": ok", ": 4xx", ": cancelled"))}
    lines = [BEGIN, "## Soak", "", f"Reproduce: `{command}`", "",
             f"`dspark serve --target {cfg['target']} --drafter {cfg['drafter']} --max-batch {cfg['max_batch']}` "
             f"in its own process ({' '.join(cfg['serve_args']) or 'no other flags'}; environment "
             f"{', '.join(f'{k}={v}' for k, v in cfg['env'].items()) or 'unchanged'}), {n} requests from "
             f"`src/dspark/bench/chaos_soak.py` (seed {cfg['seed']}): "
             + ", ".join(f"{v} {k}" for k, v in result["kinds"].items())
             + f"; {result['streams']} streamed; 1 to 6 tokens each (cancelled streams ask for 64 and are dropped "
             f"after their first event); concurrency {', '.join(map(str, CONCURRENCY))} clients in turn, "
             f"{cfg['block']} requests each. RSS of the server's processes (the HTTP process and, "
             "with --engine-process, its engine core, summed) after each block.", "",
             "| requests | RSS (MiB) | elapsed (s) |", "|---|---|---|",
             f"| 0 (started) | {fmt(samples[0]['rss_mib'], 0)} | 0 |"]
    for k in marks:
        s = next(s for s in samples if s["requests"] == k and not s.get("idle"))
        lines.append(f"| {k} | {fmt(s['rss_mib'], 0)} | {fmt(s['seconds'], 0)} |")
    idle = samples[-1]
    lines.append(f"| {n}, after 5 s idle | {fmt(idle['rss_mib'], 0)} | {fmt(idle['seconds'], 0)} |")
    ratio = rss_end / rss1k if rss1k else float("nan")
    lines += ["", f"RSS after {n} requests / after {marks[0]}: **{fmt(ratio, 3)}** (goal: within 10 %, i.e. <= 1.10). "
              f"Unexpected outcomes (5xx, cut streams, refused good requests): "
              f"{sum(bad.values())}{' ' + json.dumps(bad) if bad else ''}; tracebacks in the server log: "
              f"{result['tracebacks']}, `CancelledError`: {result['cancelled_errors']}. Slowest /health answer "
              f"during the soak: {fmt(max(s.get('health_worst_s', 0.0) for s in samples), 3)} s (goal: <= 1 s).", "",
              f"Then SIGTERM with {sd['streams']} streams running (`--shutdown-timeout {sd['timeout_s']}`): exit "
              f"status {sd['returncode']} after {fmt(sd['exit_s'], 2)} s (goal: 0 within timeout + 2 s); the "
              "streams ended: " + ", ".join(f"{v} {k}" for k, v in sd["ends"].items()) + ".",
              "", "Every sample (slowest /health: the worst of its polls every 0.2 s during the block):", "",
              "| requests | RSS (MiB) | slowest /health (s) |", "|---|---|---|"]
    lines += [f"| {s['requests']}{' idle' if s.get('idle') else ''} | {fmt(s['rss_mib'], 0)} | "
              f"{fmt(s['health_worst_s'], 3) if 'health_worst_s' in s else '-'} |" for s in samples]
    heavy = result.get("heavy") or []
    if heavy:
        lines += ["", "### Heavy inputs", "",
                  "Before the soak, one at a time, while /health is polled every 0.05 s (goal: no answer slower "
                  "than 1 s):", "", "| request | body (bytes) | status | answered in (s) | slowest /health (s) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {h['name']} | {h['bytes']} | {h['status']} | {fmt(h['seconds'], 3)} | "
                  f"{fmt(h['health_worst_s'], 3)} |" for h in heavy]
    lines += [END]
    return "\n".join(lines)


def write_soak_section(result: dict, command: str, path: str | Path) -> Path:
    """Replace (or append) the soak section of ``path``; the rest of the page is left as it is."""
    path = Path(path)
    section = render_soak(result, command)
    text = path.read_text() if path.exists() else "# Reliability under faults and load\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
    return path
