"""The OpenAI-compatible server over real HTTP (uvicorn on 127.0.0.1) with the official `openai` client.

Target: a tiny random model with SmolLM2's vocabulary (49,152) behind the real
SmolLM2 tokenizer and chat template, so prompts, chat and stop strings go
through the real text path in seconds.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from dspark.drafters.prompt_lookup import PromptLookupDrafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.scheduler.sps import SPSTable
from dspark.serving.engine import Engine, EngineConfig
from dspark.bench.serve_load import run_point, write_report
from dspark.serving.metrics import metric_sum, parse_prometheus
from dspark.scheduler.adapter import make_policy
from dspark.serving.server import ServerConfig, ServerThread, create_app
from dspark.serving.text import TextStream
from tests.tiny import smollm2_tokenizer, tiny_target

MODEL = "tiny-smollm2"
KEY = "sk-test-key"
CONTEXT = 4096


@pytest.fixture(scope="module")
def target():
    tokenizer = smollm2_tokenizer()
    t = tiny_target(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=CONTEXT, eos_token_id=2)
    t.tokenizer = tokenizer
    return t


@pytest.fixture(scope="module")
def server(target):
    sps = SPSTable((1, 4, 8), (1.0, 0.8, 0.5), 64)
    engine = Engine(target, PromptLookupDrafter(target.vocab_size, 5), make_policy("alg1", sps, fallback_confidence=0.6),
                    EngineConfig(max_batch=2, max_queue=1))
    app = create_app(engine, target.tokenizer, ServerConfig(model_name=MODEL, api_key=KEY, default_max_tokens=16))
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _plain_greedy(target, prompt_ids, n):
    return SpeculativeGenerator(target).generate([prompt_ids], SamplingParams(0.0, max_new_tokens=n))[0].output_ids


def _decode(target, ids):
    return target.tokenizer.decode(ids, skip_special_tokens=True)


def test_completion_greedy_equals_plain_target(client, target):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    expected = _plain_greedy(target, target.tokenizer.encode(prompt), 40)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == _decode(target, expected)
    assert choice.finish_reason == ("stop" if expected[-1] == 2 else "length")
    assert resp.usage.prompt_tokens == len(target.tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == len(expected)
    # the same through token-id prompts, and the default max_tokens of the server (16)
    resp = client.completions.create(model=MODEL, prompt=target.tokenizer.encode(prompt), temperature=0)
    assert resp.choices[0].text == _decode(target, expected[:16])


def test_chat_streaming_equals_non_streaming(client, target):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: one two three"}]
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = _decode(target, _plain_greedy(target, list(ids), 30))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streaming_completion_and_seeded_sampling(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=1.0, top_k=50, seed=7)
    first = client.completions.create(**{k: v for k, v in kwargs.items() if k != "top_k"},
                                      extra_body={"top_k": 50})
    streamed = client.completions.create(**{k: v for k, v in kwargs.items() if k != "top_k"},
                                         extra_body={"top_k": 50}, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == first.choices[0].text


def test_stop_string_cuts_the_text(client, target):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "the generated text is too short to pick a stop string"
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_text_stream_holds_back_partial_stop_strings(target):
    tok = target.tokenizer
    ids = tok.encode("hello world, stop here please")
    stream = TextStream(tok, ["stop here"])
    out = "".join(stream.add([t]) for t in ids)
    assert stream.stopped and out == "hello world, "
    plain = TextStream(tok, [])
    assert "".join(plain.add([t]) for t in ids) + plain.flush() == tok.decode(ids)


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    resp = httpx.get(f"{server.url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = parse_prometheus(resp.text)
    for name in ("dspark_acceptance_length", "dspark_verified_tokens_total", "dspark_accepted_tokens_total",
                 "dspark_batch_size", "dspark_queue_depth", "dspark_requests_total",
                 "dspark_prefix_cache_hit_tokens_total", "dspark_drafted_steps_total"):
        assert any(n == name for n, _ in samples), name
    assert metric_sum(samples, "dspark_requests_total") >= 1
    assert metric_sum(samples, "dspark_acceptance_length") >= 1.0
    for line in resp.text.splitlines():  # every line is a comment or "name{labels} number"
        assert line.startswith("# ") or float(line.rsplit(" ", 1)[1]) >= 0


def test_api_key_is_required(server):
    for key in ("wrong-key", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ({"prompt": [5] * CONTEXT}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": 3}, 400, "prompt"),
    ({}, 400, "prompt"),
])
def test_bad_completion_requests(server, body, status, param):
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["param"] is not None and error["param"].startswith(param)


@pytest.mark.parametrize("path, raw, param", [
    ("completions", b'{"prompt": "abc\\ud800"}', "prompt"),
    ("completions", b'{"prompt": "abc", "model": "x\\udc00"}', "model"),
    ("completions", b'{"prompt": "abc", "stop": ["\\ud800"]}', "stop"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages"),
])
def test_lone_surrogates_are_shaped_400s(server, path, raw, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    resp = httpx.post(f"{server.url}/v1/{path}", content=raw, headers=headers)
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json"), resp.text
    assert resp.json()["error"]["param"].startswith(param)


@pytest.fixture(scope="module")
def strict_server(target):
    """A server with small limits: 2,000-byte bodies, 24-token prompts."""
    engine = Engine(target, None, None, EngineConfig(max_batch=2, max_queue=2))
    config = ServerConfig(model_name=MODEL, default_max_tokens=4, max_body_bytes=2000, max_prompt_tokens=24)
    with ServerThread(create_app(engine, target.tokenizer, config)) as srv:
        yield srv


def test_body_and_prompt_limits(strict_server):
    url = f"{strict_server.url}/v1/completions"
    big = json.dumps({"prompt": "x" * 5000}).encode()
    declared = httpx.post(url, content=big, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 500):
            yield big[i : i + 500]

    streamed = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    long_prompt = httpx.post(url, json={"prompt": " ".join(["word"] * 60)})
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["code"] == "prompt_too_long"
    ok = httpx.post(url, json={"prompt": "hello there", "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{strict_server.url}/health").json() == {"status": "ok"}


def test_bad_chat_requests(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])


def test_queue_full_gives_429(client, server):
    engine = server.engine
    engine.pause()  # nothing is admitted: 2 slots + 1 queue place = 3 requests fit, the 4th is refused
    results = []

    def call():
        results.append(client.completions.create(model=MODEL, prompt="a b c", max_tokens=3, temperature=0))

    threads = [threading.Thread(target=call) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while engine.stats().queue_depth < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError, match="retry later"):
            client.completions.create(model=MODEL, prompt="a b c", max_tokens=3)
    finally:
        engine.resume()
        for t in threads:
            t.join(30)
    assert len(results) == 3 and all(r.choices[0].finish_reason for r in results)


def _wait_cancelled(engine, before):
    deadline = time.monotonic() + 30  # the connection is closed: the engine must drop the request
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.requests.get("cancelled", 0) > before and stats.batch_size == 0:
            break
        time.sleep(0.02)
    # "cancelled", not "length": the 3000-token request did not run to its end
    assert stats.requests.get("cancelled", 0) == before + 1 and stats.batch_size == 0


def test_client_disconnect_frees_the_slot(server):
    engine = server.engine
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Tell me a very long story", "max_tokens": 3000, "temperature": 1.0}
    before = engine.stats().requests.get("cancelled", 0)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200
        first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    _wait_cancelled(engine, before)

    before = engine.stats().requests.get("cancelled", 0)  # non-streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(60, read=0.5))
    _wait_cancelled(engine, before)


def test_load_generator_and_report(server, tmp_path):
    prompts = ["Count from one to ten.", "Name three colours.", "What is two plus two?"]
    drafted = server.engine.stats().drafted_steps
    row = run_point(server.url, prompts, concurrency=2, num_requests=3, max_tokens=6, temperature=0.0,
                    policy="alg1", api_key=KEY)
    drafted = server.engine.stats().drafted_steps - drafted  # prompt lookup drafts where the context repeats itself
    assert row["requests"] == 3 and row["errors"] == 0
    assert row["total_tokens_per_s"] > 0 and row["user_tokens_per_s"] > 0
    assert row["acceptance_length"] >= 1.0 and row["avg_verify_len"] is not None
    assert row["verify_ms"] > 0  # the engine's timings of the point, from /metrics
    assert (row["draft_ms"] > 0) if drafted else (row["draft_ms"] is None)
    observed = server.engine.step_times.table("verify")  # what the engine saw during the point
    meta = {"config": {"target": MODEL}, "observed_verify_sps": observed.to_dict(), "observed_prefill_sps": None}
    paths = write_report([row, {**row, "concurrency": 1}], meta, tmp_path, "dspark bench serve")
    names = {p.name for p in paths}
    assert {"serve_load.json", "serve_load.md", "throughput_vs_user_speed.png", "verify_budget.png",
            "observed_verify_sps.json"} <= names and "observed_prefill_sps.json" not in names
    assert "| alg1 | 2 | 3 |" in (tmp_path / "serve_load.md").read_text()
    assert SPSTable.load(tmp_path / "observed_verify_sps.json") == observed
