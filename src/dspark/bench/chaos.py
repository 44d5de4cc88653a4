"""`dspark bench chaos`: faults and load against an in-process server on 127.0.0.1, written to docs/reports/reliability.md.

Four measurements, each against what one bad client could do to the others:

1. malformed requests (``chaos_corpus``): tracebacks in the server log and answers not in OpenAI's error
   shape (goal: 0 and 0), plus 5xx answers;
2. ``clients`` concurrent clients, half streaming: requests lost (goal 0);
3. head-of-line blocking: a short greedy stream's worst inter-token gap while a long prompt is prefilled,
   as a ratio to the same stream alone, with chunked prefill and with whole-prompt prefill (the before);
4. slow connections (half a request line, then nothing): how long the server holds them, against the
   header timeout, while /health keeps answering.

The target is ``tiny`` (a random 2-layer model with SmolLM2's vocabulary and tokenizer: the server path
without the model's cost) or a preset / HF folder such as ``smollm2-135m``.
"""

from __future__ import annotations

import json
import logging
import platform
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from dspark.bench.chaos_corpus import Case, corpus
from dspark.tables import fmt

API_KEY = "sk-chaos"
SHORT_PROMPT = "Count slowly from one to one hundred: one, two, three,"


@dataclass
class ChaosConfig:
    target: str = "tiny"
    device: str = "cpu"  # cpu | cuda
    drafter: str = "prompt-lookup"
    clients: int = 64
    slow_connections: int = 64
    header_timeout_s: float = 2.0
    prefill_chunk: int = 256
    long_prompt_tokens: int = 3000
    short_tokens: int = 64  # tokens of the short stream
    hol_trials: int = 3
    max_batch: int = 8
    max_body_bytes: int = 1024 * 1024


class LogCounter(logging.Handler):
    """Counts log records that carry a traceback (exc_info, or 'Traceback' in the text)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.tracebacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.tracebacks.append(f"{record.name}: {record.getMessage()[:200]}")


def _tiny_target(context: int = 4096):
    """A random 2-layer decoder with SmolLM2's vocabulary, behind SmolLM2's tokenizer."""
    import torch

    from dspark.modeling.decoder import CausalLM
    from dspark.modeling.spec import spec_from_config
    from dspark.target.convert import resolve_model_path
    from dspark.target.model import TargetModel, load_tokenizer
    from dspark.target.presets import DEFAULT_TARGET

    torch.manual_seed(0)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "intermediate_size": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": context,
           "rope_theta": 10000.0, "tie_word_embeddings": True}
    model = CausalLM(spec_from_config(cfg))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return TargetModel(model, load_tokenizer(resolve_model_path(DEFAULT_TARGET)), "tiny", None, [], context)


def _start_server(cfg: ChaosConfig):
    from dspark.drafters.options import DraftingOptions
    from dspark.drafters.registry import load_drafter
    from dspark.serving.engine import Engine, EngineConfig
    from dspark.serving.limits import uvicorn_limits
    from dspark.serving.server import ServerConfig, ServerThread, create_app
    from dspark.target.model import load_target

    if cfg.target == "tiny":
        target = _tiny_target()
        target.model.to(cfg.device)
    else:
        target = load_target(cfg.target, fuse=True, device=cfg.device)
    drafter = load_drafter(cfg.drafter, target, DraftingOptions())
    engine = Engine(target, drafter, None, EngineConfig(max_batch=cfg.max_batch, max_queue=cfg.clients,
                                                        prefill_chunk=cfg.prefill_chunk))
    app = create_app(engine, target.tokenizer, ServerConfig(model_name="chaos", api_key=API_KEY,
                                                            default_max_tokens=16, max_body_bytes=cfg.max_body_bytes))
    server = ServerThread(app, log_level="info", **uvicorn_limits(header_timeout_s=cfg.header_timeout_s))
    server.engine = engine
    return server.start()


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


# =============================================================== 1. malformed requests
def openai_error_shape(content_type: str, body: bytes) -> bool:
    """``{"error": {"message": str, "type": str, "param": ..., "code": ...}}`` as application/json."""
    if not content_type.startswith("application/json"):
        return False
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and "code" in error)


def _send_raw(host: str, port: int, raw: bytes) -> tuple[int | None, str, bytes]:
    """(status, content type, body) of the answer to ``raw`` bytes; status None when closed without one."""
    data = b""
    with socket.create_connection((host, port), timeout=30) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) < 2 or not parts[1].isdigit():
        return None, "", b""
    headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    content_type = next((v.strip() for k, v in headers.items() if k.lower() == "content-type"), "")
    return int(parts[1]), content_type, body


def run_corpus(server, cases: list[Case]) -> list[dict]:
    rows = []
    with httpx.Client(timeout=60) as client:
        for case in cases:
            row = {"category": case.category, "name": case.name}
            try:
                if case.raw is not None:
                    status, content_type, body = _send_raw(server.host, server.port, case.raw)
                else:
                    resp = client.request(case.method, server.url + case.path, headers=case.headers,
                                          content=case.chunks() if case.chunked else case.body)
                    status, content_type, body = resp.status_code, resp.headers.get("content-type", ""), resp.content
                row["status"] = status
                row["shaped"] = None if status is None else status < 400 or openai_error_shape(content_type, body)
            except httpx.TransportError as err:  # the server closed before the client finished sending
                row.update(status=None, shaped=None, transport=type(err).__name__)
            rows.append(row)
    return rows


# =============================================================== 2. concurrent clients
def run_clients(url: str, clients: int) -> dict:
    prompts = ["Name three colours.", "What is two plus two?", "Write a haiku about rain.", "Count to five."]

    def one(i: int) -> tuple[bool, float]:
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0}
        t0 = time.perf_counter()
        try:
            with httpx.Client(timeout=300) as c:
                if body["stream"]:
                    with c.stream("POST", f"{url}/v1/completions", json=body, headers=_headers()) as resp:
                        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
                    ok = resp.status_code == 200 and lines[-1] == "data: [DONE]" and '"finish_reason": "' in lines[-2]
                else:
                    resp = c.post(f"{url}/v1/completions", json=body, headers=_headers())
                    ok = resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] is not None
        except (httpx.HTTPError, IndexError, KeyError, ValueError):
            ok = False
        return ok, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(clients)))
    latencies = sorted(s for _, s in results)
    return {"clients": clients, "lost": sum(not ok for ok, _ in results), "wall_s": time.perf_counter() - t0,
            "p50_latency_s": statistics.median(latencies), "max_latency_s": latencies[-1]}


# =============================================================== 3. head-of-line blocking
def _worst_gap(url: str, tokens: int, started: threading.Event | None = None) -> float:
    body = {"prompt": SHORT_PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_headers(), timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                if started is not None and len(stamps) == 2:
                    started.set()
    return max(b - a for a, b in zip(stamps, stamps[1:]))


def run_hol(url: str, engine, cfg: ChaosConfig) -> list[dict]:
    """Per prefill mode: the short stream's worst gap alone and while a long prompt arrives (median of trials)."""
    vocab = engine.target.vocab_size
    long_prompt = [(7919 * i) % (vocab - 200) + 100 for i in range(cfg.long_prompt_tokens)]
    rows = []
    for chunk in (cfg.prefill_chunk, None):
        engine.config.prefill_chunk = chunk  # read at every chunk
        solo, loaded = [], []
        for _ in range(cfg.hol_trials):
            solo.append(_worst_gap(url, cfg.short_tokens))
            started = threading.Event()

            def send_long() -> None:
                started.wait(60)
                httpx.post(f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 2},
                           headers=_headers(), timeout=600)

            sender = threading.Thread(target=send_long)
            sender.start()
            loaded.append(_worst_gap(url, cfg.short_tokens, started))
            sender.join()
        s, g = statistics.median(solo), statistics.median(loaded)
        rows.append({"prefill_chunk": chunk, "solo_worst_gap_s": s, "loaded_worst_gap_s": g, "ratio": g / s})
    engine.config.prefill_chunk = cfg.prefill_chunk
    return rows


# =============================================================== 4. slow connections
def run_slow(server, count: int, header_timeout_s: float) -> dict:
    held: list[float] = []
    lock = threading.Lock()

    def slowloris() -> None:
        t0 = time.perf_counter()
        sock = socket.create_connection((server.host, server.port), timeout=10 * header_timeout_s + 30)
        try:
            sock.sendall(b"POST /v1/completions HT")
            while sock.recv(4096):
                pass
            seconds = time.perf_counter() - t0
        except OSError:
            seconds = float("inf")  # still open at the socket timeout
        finally:
            sock.close()
        with lock:
            held.append(seconds)

    threads = [threading.Thread(target=slowloris) for _ in range(count)]
    for t in threads:
        t.start()
    time.sleep(header_timeout_s / 2)
    health = httpx.get(f"{server.url}/health", timeout=30)  # while every slow connection is open
    for t in threads:
        t.join()
    return {"connections": count, "header_timeout_s": header_timeout_s, "max_held_s": max(held),
            "median_held_s": statistics.median(held), "health_during": health.status_code}


# =============================================================== the run and the page
def run_chaos(cfg: ChaosConfig, log=print) -> dict:
    counter = LogCounter()
    server = _start_server(cfg)
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access", "dspark"):
        logging.getLogger(name).addHandler(counter)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)  # a line per request is noise here
    engine = server.engine
    try:
        target = engine.target
        cases = corpus(API_KEY, target.max_context, target.vocab_size, cfg.max_body_bytes)
        log(f"[chaos] {len(cases)} malformed requests")
        corpus_rows = run_corpus(server, cases)
        log(f"[chaos] {cfg.clients} concurrent clients")
        clients = run_clients(server.url, cfg.clients)
        log("[chaos] head-of-line blocking")
        hol = run_hol(server.url, engine, cfg)
        log(f"[chaos] {cfg.slow_connections} slow connections")
        slow = run_slow(server, cfg.slow_connections, cfg.header_timeout_s)
        health = httpx.get(f"{server.url}/health", timeout=30).status_code
    finally:
        server.stop()
        for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access", "dspark"):
            logging.getLogger(name).removeHandler(counter)
    return {"config": asdict(cfg), "corpus": corpus_rows, "clients": clients, "hol": hol, "slow": slow,
            "health_after": health, "tracebacks": sorted(set(counter.tracebacks)),
            "traceback_count": len(counter.tracebacks), "platform": platform.platform(),
            "python": sys.version.split()[0]}


def render(result: dict, command: str) -> str:
    cfg, rows = result["config"], result["corpus"]
    answered = [r for r in rows if r["status"] is not None]
    unshaped = [r for r in answered if not r["shaped"]]
    server_errors = [r for r in answered if r["status"] >= 500]
    closed = [r for r in rows if r["status"] is None]
    lines = [
        "# Reliability under faults and load", "",
        f"Reproduce: `{command}`", "",
        f"Target `{cfg['target']}`, drafter `{cfg['drafter']}`, in-process server on 127.0.0.1 (max batch "
        f"{cfg['max_batch']}, body limit {cfg['max_body_bytes']} bytes, header timeout {cfg['header_timeout_s']} s, "
        f"prefill chunk {cfg['prefill_chunk']} tokens); {result['platform']}, Python {result['python']}. "
        "Written by `dspark bench chaos` (`src/dspark/bench/chaos.py`, corpus in `chaos_corpus.py`).", "",
        "## Summary", "",
        "| check | goal | measured |", "|---|---|---|",
        f"| malformed requests sent | >= 150 | {len(rows)} |",
        f"| tracebacks in the server log | 0 | {result['traceback_count']} |",
        f"| answers not in OpenAI's error shape | 0 | {len(unshaped)} |",
        f"| 5xx answers to malformed requests | 0 | {len(server_errors)} |",
        f"| requests lost of {result['clients']['clients']} concurrent clients | 0 | {result['clients']['lost']} |",
        f"| head-of-line ratio, prefill chunk {cfg['prefill_chunk']} | small | {fmt(result['hol'][0]['ratio'], 1)} |",
        f"| head-of-line ratio, whole-prompt prefill (before) | - | {fmt(result['hol'][1]['ratio'], 1)} |",
        f"| longest a slow connection was held (s) | <= {cfg['header_timeout_s']} + slack | "
        f"{fmt(result['slow']['max_held_s'], 2)} |",
        f"| /health after the run | 200 | {result['health_after']} |", "",
        "## Malformed requests", "",
        "Answers per category. 2xx: accepted as sent (numbers as strings coerced, unknown fields ignored, a BOM "
        "or UTF-16 body decoded). `closed`: the server closed the connection before the client finished "
        "sending. `malformed HTTP` is refused by the protocol layer before the app, also in OpenAI's shape.", "",
        "| category | cases | 2xx | 4xx | 5xx | closed | not OpenAI-shaped |", "|---|---|---|---|---|---|---|",
    ]
    for category in dict.fromkeys(r["category"] for r in rows):
        group = [r for r in rows if r["category"] == category]
        count = lambda lo, hi: sum(1 for r in group if r["status"] is not None and lo <= r["status"] < hi)  # noqa: E731
        lines.append(f"| {category} | {len(group)} | {count(200, 300)} | {count(400, 500)} | {count(500, 600)} | "
                     f"{sum(r['status'] is None for r in group)} | {sum(r['shaped'] is False for r in group)} |")
    if unshaped or server_errors or result["tracebacks"]:
        lines += ["", "Failures:", ""]
        lines += [f"- {r['category']} / {r['name']}: {r['status']}" for r in unshaped + server_errors]
        lines += [f"- log: {t}" for t in result["tracebacks"]]
    c = result["clients"]
    lines += [
        "", "## Concurrent clients", "",
        f"{c['clients']} clients at once (half streaming), 16 greedy tokens each: {c['lost']} lost, "
        f"median latency {fmt(c['p50_latency_s'], 2)} s, slowest {fmt(c['max_latency_s'], 2)} s, "
        f"all done in {fmt(c['wall_s'], 2)} s.", "",
        "## Head-of-line blocking", "",
        f"A greedy stream of {cfg['short_tokens']} tokens, alone and while a {cfg['long_prompt_tokens']}-token prompt "
        f"arrives after its first token; worst gap between two of its events, median of {cfg['hol_trials']} trials. "
        "Ratio = loaded / alone. With chunks it is about (decode step + one chunk) / decode step, whatever the "
        "prompt's length; a smaller --prefill-chunk lowers it at some cost in prefill throughput. Absolute times "
        "depend on the machine's load; the ratios are the point.", "",
        "| prefill | worst gap alone (s) | worst gap with the long prompt (s) | ratio |", "|---|---|---|---|",
    ]
    for r in result["hol"]:
        mode = f"chunks of {r['prefill_chunk']}" if r["prefill_chunk"] else "whole prompt (before)"
        lines.append(f"| {mode} | {fmt(r['solo_worst_gap_s'], 3)} | {fmt(r['loaded_worst_gap_s'], 3)} | "
                     f"{fmt(r['ratio'], 1)} |")
    s = result["slow"]
    lines += [
        "", "## Slow connections", "",
        f"{s['connections']} connections send half a request line and wait: the server closed them after "
        f"{fmt(s['median_held_s'], 2)} s (median), {fmt(s['max_held_s'], 2)} s at most, against a header timeout of "
        f"{s['header_timeout_s']} s; /health answered {s['health_during']} while they were open. Without the header "
        "timeout uvicorn holds such a connection for as long as the client keeps it.", "",
    ]
    return "\n".join(lines)


def limits_section() -> list[str]:
    """What bounds each user-controlled input and what shutdown does (the values are the code's own)."""
    from dspark.serving.cli import CPU_MAX_PROMPT_TOKENS
    from dspark.serving.limits import DEFAULT_MAX_BODY_BYTES
    from dspark.serving.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
    from dspark.serving.shutdown import ABORT_GRACE_S, FORCE_GRACE_S

    return [
        "## Limits and shutdown", "",
        "What keeps one request from costing the event loop or the engine more than a moment (each a 400 in "
        "OpenAI's shape naming the field, tested in `tests/serving/test_bounded_inputs.py`; the Soak section's "
        "heavy-input table measures /health while each is sent):", "",
        f"- request body: at most {DEFAULT_MAX_BODY_BYTES} bytes (`--max-body-bytes`), since it is parsed on the "
        "event loop (JSON holds the GIL); larger bodies get 413 unread;",
        f"- stop strings: at most {MAX_STOP_STRINGS}, each at most {MAX_STOP_CHARS} characters, matched by a "
        "Knuth-Morris-Pratt matcher (`serving/text.py`) whose work is linear in the text and the stop strings;",
        f"- `stop_token_ids`: at most {MAX_STOP_TOKEN_IDS};",
        "- `chat_template_kwargs`: no key the template call sets itself (`messages`, `tools`, `documents`, "
        "`add_generation_prompt`, the arguments of `apply_chat_template`, `raise_exception`, `strftime_now`, "
        "the tokenizer's special tokens): refused with the key named (`prompts.reserved_template_names`);",
        "- prompts: type-checked and tokenised in a worker thread; a text with more characters than (longest "
        "token) x (prompt limit), or more messages than the prompt limit, is refused before tokenising; "
        f"`--max-prompt-tokens` defaults to {CPU_MAX_PROMPT_TOKENS} on a CPU (the model's context on a GPU);",
        "- `n`, `logit_bias` and the other unsupported fields are refused by value, without work per entry.",
        "",
        "On SIGTERM (`serving/shutdown.py`): new requests get 503 (`shutting_down`) at once and /health says "
        "503, while the listening socket stays open; running and queued requests go on for `--shutdown-timeout` "
        "seconds; then each remaining stream gets an error event and `data: [DONE]`, each other request a 503 in "
        f"OpenAI's shape; uvicorn is left nothing to cancel (at most {ABORT_GRACE_S} + {FORCE_GRACE_S} s more) "
        "and the process exits 0. Tested against a real `dspark serve` in `tests/serving/test_shutdown.py`; "
        "the Soak section times it.", "",
        "Memory (`serving/memory.py`, `--malloc-tuning`, on by default): oneDNN's primitive cache (a compiled"
        " kernel with its buffers per new matmul shape, 1,024 by default) capped at 256 and ideep's "
        'computation cache in front of it (`LRU_CACHE_CAPACITY`, 1,024 by default; "What grew" below) capped '
        "at 64, two malloc arenas, and `malloc_trim` every 64 requests; the objects alive after start-up are "
        "frozen out of the garbage collector (`gc.freeze`); the Soak section measures RSS with them. glibc's "
        "mmap and trim thresholds are left dynamic: the Soak runs below had them fixed at 256 / 512 KiB, which "
        "halved the server's throughput at 16 clients (docs/serving/malloc.md).", "",
        "The engine core runs in its own process (`serving/engine_process.py`, `--engine-process`, on by "
        "default; docs/serving.md, Engine): a crash of it (SIGKILL, out of memory, a native fault) ends every"
        " open stream with an error event and `data: [DONE]` and every other open request with a 500 in "
        "OpenAI's shape, `/health` then answers 503 and new requests 503; nothing hangs "
        "(`tests/serving/test_engine_process.py`). On SIGTERM the HTTP process drains as above and then stops"
        " the core, which ignores the signal itself.", "",
    ]


#: a hand-written part of the page (a diagnosis, a study) that a rerun keeps, as it keeps the Soak section
KEEP_BEGIN, KEEP_END = "<!-- kept: written by hand, kept by dspark bench chaos -->", "<!-- /kept -->"


def write_page(result: dict, command: str, path: str | Path) -> Path:
    """The page; the hand-written block (``KEEP_BEGIN``) and the Soak section a `--soak` run wrote
    (``chaos_soak``) are kept, in that order, and whatever follows the Soak section too."""
    from dspark.bench.chaos_soak import BEGIN, END

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    page = render(result, command).rstrip("\n") + "\n\n" + "\n".join(limits_section())
    for begin, end in ((KEEP_BEGIN, KEEP_END), (BEGIN, END)):
        if begin in old and end in old:
            after = old.split(begin, 1)[1].split(end, 1)
            page = page.rstrip("\n") + "\n\n" + begin + after[0] + end + "\n"
    if BEGIN in old and END in old and (tail := old.split(END, 1)[1].strip()):
        page += "\n" + tail + "\n"
    path.write_text(page)
    return path
