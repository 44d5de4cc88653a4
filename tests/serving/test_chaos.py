"""No single client can stall the server: slow request heads are dropped, and a huge body plus a long prompt
leave a concurrent stream's inter-token latency bounded (chunked prefill).

Target: a tiny random model with SmolLM2's vocabulary behind the real SmolLM2 tokenizer, as in test_server.py.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from dspark.bench.chaos import API_KEY, LogCounter, run_corpus
from dspark.bench.chaos_corpus import corpus
from dspark.serving.engine import Engine, EngineConfig
from dspark.serving.limits import uvicorn_limits
from dspark.serving.server import ServerConfig, ServerThread, create_app
from tests.tiny import smollm2_tokenizer, tiny_target

MODEL = "tiny-smollm2"
CONTEXT = 4096
HEADER_TIMEOUT_S = 0.5
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HOL_FACTOR = 20  # generous: chunks of 64 measure ~2x here, the prompt in one piece ~70x


@pytest.fixture(scope="module")
def server():
    tokenizer = smollm2_tokenizer()
    target = tiny_target(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=CONTEXT, eos_token_id=2)
    target.tokenizer, target.eos_token_ids = tokenizer, []  # streams run their full length
    engine = Engine(target, None, None, EngineConfig(max_batch=4, max_queue=8, prefill_chunk=64))
    config = ServerConfig(model_name=MODEL, api_key=API_KEY, default_max_tokens=8, max_body_bytes=1024 * 1024)
    app = create_app(engine, tokenizer, config)
    with ServerThread(app, **uvicorn_limits(header_timeout_s=HEADER_TIMEOUT_S)) as srv:
        srv.engine = engine
        yield srv


def _raw_connection(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=30)


def _closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes (b"") or the 30 s socket timeout."""
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def test_slow_request_head_is_dropped(server):
    slow = _raw_connection(server)
    slow.sendall(b"POST /v1/completions HT")  # half a request line, then nothing
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "temperature": 0}, headers=AUTH,
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert _closed_by_server(slow)

    # keep-alive: after one full request, a second head that trickles in is dropped as well
    again = _raw_connection(server)
    again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert again.recv(4096).startswith(b"HTTP/1.1 200")
    again.sendall(b"GET /health HTTP/1.1\r\nHo")
    assert _closed_by_server(again)


def test_header_timeout_spares_slow_responses(server):
    """Negative control: a response that takes longer than the header timeout is not cut."""
    engine = server.engine
    engine.pause()  # the request waits in the queue for 3 header timeouts
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, headers=AUTH,
                     timeout=30)))
    thread.start()
    try:
        time.sleep(3 * HEADER_TIMEOUT_S)
    finally:
        engine.resume()
    thread.join(30)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 3


def _stream_gaps(url: str, started: threading.Event | None = None) -> list[float]:
    """Seconds between the SSE events of one greedy 100-token stream."""
    body = {"prompt": "Count: one two three four", "max_tokens": 100, "temperature": 0, "stream": True}
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:])
                stamps.append(time.perf_counter())
                if started is not None and len(stamps) == 2:
                    started.set()
    assert len(stamps) > 50
    return [b - a for a, b in zip(stamps, stamps[1:])]


def test_huge_body_and_long_prompt_leave_a_stream_flowing(server):
    solo = max(_stream_gaps(server.url))
    started, answers = threading.Event(), {}

    def huge_body():
        started.wait(30)
        try:  # 20 MB, over the 1 MB limit: 413 (the server may close before the upload ends)
            answers["huge"] = httpx.post(f"{server.url}/v1/completions", content=b"x" * 20_000_000,
                                         headers={**AUTH, "Content-Type": "application/json"}, timeout=60).status_code
        except httpx.TransportError:
            answers["huge"] = "closed"

    def long_prompt():
        started.wait(30)
        prompt = [(7 * i) % 40000 + 100 for i in range(3500)]  # 55 chunks of 64
        answers["long"] = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4},
                                     headers=AUTH, timeout=60).json()

    threads = [threading.Thread(target=f) for f in (huge_body, long_prompt)]
    for t in threads:
        t.start()
    chaos = max(_stream_gaps(server.url, started))
    for t in threads:
        t.join(60)
    assert answers["huge"] in (413, "closed")
    assert answers["long"]["usage"] == {"prompt_tokens": 3500, "completion_tokens": 4, "total_tokens": 3504}
    assert server.engine.stats().prompt_tokens >= 3500
    assert chaos <= HOL_FACTOR * solo, (chaos, solo)


def test_malformed_requests_get_shaped_errors_and_no_tracebacks(server):
    """The corpus of `dspark bench chaos`: every error in OpenAI's JSON shape (HTTP the parser refuses included),
    no 5xx, no traceback in the server log."""
    counter = LogCounter()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.access")]
    for logger in loggers:
        logger.addHandler(counter)
    try:
        target = server.engine.target
        rows = run_corpus(server, corpus(API_KEY, CONTEXT, target.vocab_size, 1024 * 1024))
        found = list(counter.tracebacks)
        logging.getLogger("uvicorn.error").error("probe", exc_info=ValueError("probe"))  # negative control
    finally:
        for logger in loggers:
            logger.removeHandler(counter)
    assert len(rows) >= 150
    assert [r for r in rows if r["shaped"] is False or (r["status"] or 0) >= 500] == []
    assert found == [] and len(counter.tracebacks) == 1  # the counter does see a traceback
    garbage = [r for r in rows if r["category"] == "malformed HTTP"]
    assert garbage and all(r["status"] == 400 for r in garbage if r["name"] in ("garbage", "no version"))
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
