"""The engine core in its own process (``dspark.serving.engine_process``): the same tokens as the in-process
engine, the server's behaviour over it, and a crash of the core reported on every open stream and on /health.

Target: a tiny random HF folder with SmolLM2's tokenizer (``tests.tiny.save_chat_target``), loaded by the
spawned core from disk, as `dspark serve` does.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from dspark.errors import ModelLoadError
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import Engine, EngineClosedError, EngineConfig, QueueFullError
from dspark.serving.engine_process import EngineProcess
from dspark.serving.server import ServerConfig, ServerThread, create_app
from dspark.target.model import load_target, load_tokenizer
from tests.tiny import save_chat_target

MAX_BATCH, MAX_QUEUE = 2, 2


def build_tiny(folder: str, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE) -> Engine:
    """Runs in the spawned core: module level, so the child can import it."""
    return Engine(load_target(folder), config=EngineConfig(max_batch=max_batch, max_queue=max_queue))


def build_fails(folder: str) -> Engine:
    raise ModelLoadError(f"no model in {folder}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path, _ = save_chat_target(tmp_path_factory.mktemp("tiny"), max_position_embeddings=8192, num_hidden_layers=2)
    return str(path)


@pytest.fixture()
def core(folder):
    engine = EngineProcess(build_tiny, folder).start()
    yield engine
    engine.stop()


def test_same_tokens_as_the_in_process_engine(core, folder):
    prompts = [[1, 2, 3, 4, 5], [40, 41, 42], list(range(100, 160))]
    greedy = SamplingParams(0.0, max_new_tokens=12)
    seeded = SamplingParams(1.0, top_k=50, max_new_tokens=12, seed=7)
    with build_tiny(folder) as local:
        for sampling in (greedy, seeded):
            expected = [local.generate(p, sampling, timeout=60) for p in prompts]
            handles = [core.submit(p, sampling) for p in prompts]  # together: batched in the core
            assert [h.result(timeout=60)[0] for h in handles] == expected
    assert core.target.vocab_size == 49152 and core.target.max_context == 8192
    stats = core.stats()
    assert stats.requests.get("length", 0) + stats.requests.get("stop", 0) >= 1  # counters come back too


def test_submit_refuses_as_the_engine_does(core):
    with pytest.raises(Exception, match="outside the vocabulary"):
        core.submit([1, 10**6], SamplingParams(0.0, max_new_tokens=2))
    long = SamplingParams(0.0, max_new_tokens=4000)
    handles = [core.submit([5, 6, 7], long) for _ in range(MAX_BATCH + MAX_QUEUE)]
    with pytest.raises(QueueFullError):
        core.submit([5, 6, 7], long)
    for h in handles:
        h.cancel()
    for h in handles:  # a cancelled request ends, and frees its place
        assert h.result(timeout=60)[1] == "cancelled"
    assert core.generate([5, 6, 7], SamplingParams(0.0, max_new_tokens=2), timeout=60)
    assert core.stats().requests.get("rejected") == 1


def test_a_build_error_reaches_the_caller(folder):
    engine = EngineProcess(build_fails, folder)
    with pytest.raises(ModelLoadError, match="no model in"):
        engine.start()
    assert not engine.running
    with pytest.raises(EngineClosedError):  # not a silent second start with no core behind it
        engine.start()


def test_stop_aborts_open_requests(folder):
    engine = EngineProcess(build_tiny, folder).start()
    handle = engine.submit([5, 6, 7], SamplingParams(0.0, max_new_tokens=6000))
    next(handle.events(timeout=60))  # decoding
    engine.stop()
    assert not engine.running
    assert list(handle.events(timeout=30))[-1].finish_reason == "abort"


def _stream(url: str, out: dict, i: int, started: threading.Semaphore) -> None:
    body = {"prompt": f"Story {i}:", "max_tokens": 6000, "temperature": 0, "stream": True}
    lines = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 1:
                        started.release()
        out[i] = lines
    except httpx.HTTPError as err:
        out[i] = lines + [f"transport: {type(err).__name__}"]


def test_a_crash_of_the_core_ends_every_stream_and_turns_health_503(folder):
    engine = EngineProcess(build_tiny, folder).start()
    app = create_app(engine, load_tokenizer(folder), ServerConfig(model_name="tiny"))
    with ServerThread(app) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        out, started = {}, threading.Semaphore(0)
        threads = [threading.Thread(target=_stream, args=(server.url, out, i, started)) for i in range(MAX_BATCH + 1)]
        for t in threads:
            t.start()
        for _ in range(MAX_BATCH):  # two decode, one waits in the core's queue
            assert started.acquire(timeout=60)
        os.kill(engine.pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a stream hung after the core died"
        for i, lines in out.items():
            assert lines[-1] == "[DONE]", (i, lines[-3:])
            error = json.loads(lines[-2])["error"]
            assert "engine process exited" in error["message"] and error["type"] == "server_error", error
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "not running" in health.json()["error"]["message"]
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert late.status_code == 503 and "engine process exited" in late.json()["error"]["message"]
    assert len(out) == MAX_BATCH + 1
