"""Regeneration through an OpenAI-compatible server: `dspark serve` on 127.0.0.1 writes the in-process records
(greedy), and a failing or unreachable server stops the run cleanly with the records so far kept.

Target: a tiny random model with SmolLM2's vocabulary behind the real SmolLM2 tokenizer and chat template
(as tests/serving/test_server.py), so both paths go through the real text path.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from dspark.data.regenerate import encode_conversation, error_path, regenerate
from dspark.data.regenerate_http import RetryPolicy, ServerError, api_base, regenerate_over_http
from dspark.errors import DSparkError
from dspark.serving.engine import Engine, EngineConfig
from dspark.serving.server import ServerConfig, ServerThread, create_app
from tests.tiny import smollm2_tokenizer, tiny_target

MODEL = "tiny-smollm2"
KEY = "sk-regen"
FAST = RetryPolicy(retries=2, backoff_s=0.01, timeout_s=30)

RECORDS = [
    {"id": "a", "domain": "math", "conversations": [{"role": "user", "content": "What is two plus two?"}]},
    {"id": "b", "conversations": [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "ORIGINAL"}, {"role": "user", "content": "And another one?"}]},
    {"turns": ["Write a haiku about tea.", "Now one about coffee."]},
    {"id": "d", "conversations": [{"role": "user", "content": "Say hello in French."}]},
]


@pytest.fixture(scope="module")
def target():
    tokenizer = smollm2_tokenizer()
    t = tiny_target(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=2048, eos_token_id=2)
    t.tokenizer = tokenizer
    return t


@pytest.fixture(scope="module")
def server(target):
    engine = Engine(target, config=EngineConfig(max_batch=2, max_queue=8))
    app = create_app(engine, target.tokenizer, ServerConfig(model_name=MODEL, api_key=KEY))
    with ServerThread(app) as srv:
        yield srv


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dspark_serve_writes_the_in_process_records_for_greedy_decoding(tmp_path, target, server):
    src = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    here, there = tmp_path / "here.jsonl", tmp_path / "there.jsonl"
    local = regenerate(target, src, here, batch_size=2, max_new_tokens=12, temperature=0.0, progress=False)
    remote = regenerate_over_http(server.url, src, there, api_key=KEY, concurrency=3, max_new_tokens=12,
                                  temperature=0.0, progress=False, retry=FAST)
    assert (remote.succeeded, remote.failed, remote.new_tokens) == (local.succeeded, local.failed, local.new_tokens)
    assert local.succeeded == 4 and local.new_tokens > 0
    assert there.read_text() == here.read_text()
    b = read_jsonl(there)[1]["conversations"]
    assert [m["role"] for m in b] == ["system", "user", "assistant", "user", "assistant"]
    assert "ORIGINAL" not in json.dumps(b)


def test_a_seed_reproduces_sampled_records_over_http(tmp_path, server):
    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:2])
    texts = []
    for name, seed in (("x", 1), ("y", 1), ("z", 2)):
        out = tmp_path / f"{name}.jsonl"
        regenerate_over_http(f"{server.url}/v1", src, out, api_key=KEY, model=MODEL, concurrency=2,
                             max_new_tokens=10, temperature=1.0, top_p=1.0, top_k=0, seed=seed, progress=False,
                             retry=FAST)
        texts.append(out.read_text())
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]  # negative control: the seed reaches the server


def test_an_unreachable_server_fails_cleanly_and_keeps_the_records(tmp_path, server):
    src = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    out = tmp_path / "o.jsonl"
    regenerate_over_http(server.url, src, out, api_key=KEY, max_new_tokens=6, limit=1, progress=False, retry=FAST)
    kept = out.read_text()
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerError) as err:
        regenerate_over_http(url, src, out, api_key=KEY, max_new_tokens=6, progress=False, retry=FAST)
    message = str(err.value)
    assert "\n" not in message and url in message and "failed 3 times" in message and "resume" in message
    assert out.read_text() == kept
    again = regenerate_over_http(server.url, src, out, api_key=KEY, max_new_tokens=6, progress=False, retry=FAST)
    assert (again.skipped, again.succeeded) == (1, 3)
    assert [str(r["id"]) for r in read_jsonl(out)] == ["a", "b", "2", "d"]


#: appended to SmolLM2's template: a generation prompt that reads enable_thinking, as Qwen3's does
THINKING = ("{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% endif %}")


def test_both_paths_render_every_turn_with_enable_thinking_false(tmp_path):
    """DeepSpec regenerates with enable_thinking false: in process (first turn included) and over HTTP
    (``chat_template_kwargs``, rendered by the server) alike, so a Qwen3-style template gives equal records."""
    tokenizer = smollm2_tokenizer()
    tokenizer.chat_template += THINKING
    thinking = tiny_target(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=2048, eos_token_id=2)
    thinking.tokenizer = tokenizer
    first = [{"role": "user", "content": "What is two plus two?"}]
    ids = encode_conversation(thinking, first)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking.encode_chat(first[0]["content"]) == ids  # the evaluation prompts render the same way
    # negative control: the template does read the variable (without it the prompt has no empty thinking block)
    plain = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
    assert list(plain.get("input_ids", plain) if hasattr(plain, "get") else plain) != ids
    src = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    here, there = tmp_path / "here.jsonl", tmp_path / "there.jsonl"
    regenerate(thinking, src, here, batch_size=2, max_new_tokens=8, temperature=0.0, progress=False)
    engine = Engine(thinking, config=EngineConfig(max_batch=2, max_queue=8))
    with ServerThread(create_app(engine, tokenizer, ServerConfig(model_name=MODEL))) as srv:
        regenerate_over_http(srv.url, src, there, concurrency=2, max_new_tokens=8, temperature=0.0, progress=False,
                             retry=FAST)
    assert there.read_text() == here.read_text()

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return _chat_answer()

    regenerate_over_http("http://127.0.0.1:1/v1", src, tmp_path / "m.jsonl", model=MODEL, limit=1, progress=False,
                         retry=FAST, transport=httpx.MockTransport(handler))
    assert bodies and bodies[0]["chat_template_kwargs"] == {"enable_thinking": False}


def _chat_answer(text: str = "ok") -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                  "finish_reason": "stop"}],
                                     "usage": {"completion_tokens": 3}})


def test_429_and_5xx_are_retried_with_backoff(tmp_path):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) <= 2:
            return httpx.Response(503 if len(calls) == 1 else 429, json={"error": {"message": "busy"}})
        return _chat_answer()

    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:1])
    out = tmp_path / "o.jsonl"
    stats = regenerate_over_http("http://mock", src, out, model="m", progress=False, retry=FAST,
                                 transport=httpx.MockTransport(handler))
    assert stats.succeeded == 1 and calls == ["/v1/chat/completions"] * 3
    assert read_jsonl(out)[0]["conversations"][-1] == {"role": "assistant", "content": "ok"}


def test_a_server_that_starts_failing_stops_the_run_and_keeps_finished_records(tmp_path):
    answered = []

    def handler(request: httpx.Request) -> httpx.Response:
        if answered:
            return httpx.Response(500, json={"error": {"message": "out of memory"}})
        answered.append(json.loads(request.content))
        return _chat_answer()

    src = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    out = tmp_path / "o.jsonl"
    with pytest.raises(ServerError, match="HTTP 500: out of memory.*1 records are in"):
        regenerate_over_http("http://mock/v1", src, out, model="m", concurrency=1, progress=False, retry=FAST,
                             transport=httpx.MockTransport(handler))
    assert [r["id"] for r in read_jsonl(out)] == ["a"]
    assert answered[0]["messages"] == [RECORDS[0]["conversations"][0]] and answered[0]["model"] == "m"


def test_a_refused_turn_fails_only_its_record_and_a_bad_key_stops_at_once(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        if "Tell" in request.content.decode():
            return httpx.Response(400, json={"error": {"message": "context_length_exceeded"}})
        return _chat_answer()

    src = write_jsonl(tmp_path / "p.jsonl", [RECORDS[0], {"id": "long", "turns": ["Tell me everything."]}])
    out = tmp_path / "o.jsonl"
    stats = regenerate_over_http("http://mock", src, out, model="m", progress=False, retry=FAST,
                                 transport=httpx.MockTransport(handler))
    assert (stats.succeeded, stats.failed) == (1, 1)
    assert "context_length_exceeded" in read_jsonl(error_path(out))[0]["error"]

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "incorrect API key provided"}})

    with pytest.raises(ServerError, match="HTTP 401: incorrect API key"):
        regenerate_over_http("http://mock", src, tmp_path / "x.jsonl", progress=False, retry=FAST,
                             transport=httpx.MockTransport(refuse))


def test_base_urls():
    assert api_base("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert api_base("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    with pytest.raises(DSparkError, match="http"):
        api_base("127.0.0.1:8000")


def test_the_cli_reports_an_unreachable_server_in_one_line(tmp_path, capsys):
    from dspark.cli import main

    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:1])
    url = f"http://127.0.0.1:{free_port()}"
    rc = main(["data", "regenerate", "--prompts", str(src), "--out", str(tmp_path / "o.jsonl"), "--base-url", url,
               "--model", "m", "--retries", "1", "--retry-backoff", "0.01"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dspark: error:")]
    assert rc == 2 and len(errors) == 1
    assert f"{url}/v1/chat/completions failed 2 times" in errors[0] and "resume" in errors[0]
