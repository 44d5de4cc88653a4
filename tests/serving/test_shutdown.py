"""Graceful shutdown of a real `dspark serve` process on 127.0.0.1: SIGTERM with streams running and
requests queued.

Expected (``dspark.serving.shutdown``): new requests get 503 in OpenAI's shape at once; running requests go
on until --shutdown-timeout; then every remaining stream ends with an error event and ``data: [DONE]`` and
every queued non-streaming request gets a 503 in OpenAI's shape; no traceback in the log; exit status 0.

Target: a tiny random HF folder with SmolLM2's tokenizer (``tests.tiny.save_chat_target``), no drafter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dspark.bench.chaos import openai_error_shape
from tests.tiny import save_chat_target

REPO = Path(__file__).resolve().parents[2]
SHUTDOWN_TIMEOUT_S = 3.0
STREAMS, QUEUED = 8, 3
MAX_BATCH = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def served(tmp_path):
    folder, _ = save_chat_target(tmp_path / "tiny", max_position_embeddings=8192, num_hidden_layers=2)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *sys.path])}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark.cli", "--threads", "1", "serve", "--target", str(folder), "--drafter", "none",
         "--port", str(port), "--max-batch", str(MAX_BATCH), "--max-queue", "16",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--generation-config", "vllm"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            pytest.fail(f"dspark serve did not start:\n{log.read()[-3000:]}")
        time.sleep(0.2)
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def _stream(url: str, out: dict, i: int, started: threading.Semaphore) -> None:
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 6000, "temperature": 0, "stream": True}
    lines = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            out[i] = {"status": resp.status_code}
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 1:
                        started.release()
        out[i]["lines"] = lines
    except httpx.HTTPError as err:  # an incomplete chunked read: the stream was cut
        out[i] = {"status": None, "lines": lines, "transport": type(err).__name__}


def _plain(url: str, out: dict, i: int) -> None:
    body = {"prompt": f"Question {i}:", "max_tokens": 6000, "temperature": 0}
    try:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        out[i] = {"status": resp.status_code, "type": resp.headers.get("content-type", ""), "body": resp.content}
    except httpx.HTTPError as err:
        out[i] = {"status": None, "transport": type(err).__name__}


def test_sigterm_ends_every_stream_cleanly_and_exits_0(served):
    proc, url, log = served
    streams, plains, started = {}, {}, threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(url, streams, i, started)) for i in range(STREAMS)]
    threads += [threading.Thread(target=_plain, args=(url, plains, i)) for i in range(QUEUED)]
    for t in threads[:STREAMS]:
        t.start()
    for _ in range(MAX_BATCH):  # the first MAX_BATCH streams are decoding, the others wait for a slot
        assert started.acquire(timeout=60)
    for t in threads[STREAMS:]:
        t.start()
    time.sleep(0.5)  # the non-streaming requests reach the queue

    proc.send_signal(signal.SIGTERM)
    t_term = time.monotonic()
    deadline = t_term + 10
    while True:  # the signal is seen within one uvicorn tick
        health = httpx.get(f"{url}/health", timeout=10)
        if health.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503, refused.text
    assert openai_error_shape(refused.headers["content-type"], refused.content)
    assert refused.json()["error"]["code"] == "shutting_down"

    for t in threads:
        t.join(SHUTDOWN_TIMEOUT_S + 60)
    rc = proc.wait(SHUTDOWN_TIMEOUT_S + 60)  # a hang guard, not a speed check (docs/reports/reliability.md times it)
    exit_s = time.monotonic() - t_term
    log.seek(0)
    text = log.read()
    assert rc == 0, text[-3000:]

    aborted = 0
    for i in range(STREAMS):
        s = streams[i]
        assert s["status"] == 200 and "transport" not in s, (i, s)
        lines = s["lines"]
        assert lines[-1] == "[DONE]", (i, lines[-3:])
        last = json.loads(lines[-2])
        if "error" in last:  # aborted at the timeout: an error event in OpenAI's shape, then [DONE]
            assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["code"] == "shutting_down"
            aborted += 1
        else:  # it finished within the timeout
            assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert aborted >= 1  # the timeout was reached with streams running: the check saw the abort path
    for i in range(QUEUED):
        p = plains[i]
        assert p["status"] in (200, 503), p
        if p["status"] == 503:
            assert openai_error_shape(p["type"], p["body"]) and json.loads(p["body"])["error"]["code"] == "shutting_down"
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert "Cancel " not in text  # uvicorn had no task left to cancel
    print(f"exit {exit_s:.2f} s after SIGTERM, {aborted} of {STREAMS} streams aborted")
