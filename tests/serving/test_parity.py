"""The OpenAI server against vLLM's: chat_template_kwargs, generation_config.json defaults, max_tokens up to
the context, a 400 for every vLLM field we do not implement, usage up to the stop string, vLLM-named
Prometheus metrics, and incremental detokenisation.

Target: a tiny random model with SmolLM2's vocabulary behind the real SmolLM2 tokenizer (as in
test_server.py), with a 160-token context and a Qwen3-style chat template that reads ``enable_thinking``.
"""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from dspark.drafters.draft_lm.drafter import DraftModelDrafter
from dspark.drafters.prompt_lookup import PromptLookupDrafter
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.serving.engine import Engine, EngineConfig
from dspark.serving.metrics import metric_sum, parse_prometheus
from dspark.serving.params import SamplingDefaults
from dspark.serving.protocol import CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, ANY
from dspark.serving.server import ServerConfig, ServerThread, create_app
from dspark.serving.text import IncrementalDecoder, TextStream
from tests.tiny import smollm2_tokenizer, tiny_target

MODEL = "tiny-parity"
CONTEXT = 160
THINKING_TEMPLATE = (  # Qwen3's switch: an empty think block when enable_thinking is false
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
REPEATING = "one two three four five six seven. one two three four five six seven. one two three"


@pytest.fixture(scope="module")
def tokenizer():
    tok = smollm2_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def target(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")  # the server reads its sampling defaults from here
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0, "top_k": 20}))
    t = tiny_target(vocab_size=49152, num_hidden_layers=2, max_position_embeddings=CONTEXT, eos_token_id=2)
    t.tokenizer, t.path, t.eos_token_ids = tokenizer, folder, []  # no EOS: streams run their full length
    return t


def _app(target, drafter=None, **config):
    drafter = drafter or PromptLookupDrafter(target.vocab_size, 4)
    engine = Engine(target, drafter, None, EngineConfig(max_batch=2, max_queue=4))
    return create_app(engine, target.tokenizer, ServerConfig(model_name=MODEL, **config))


@pytest.fixture(scope="module")
def server(target):
    with ServerThread(_app(target)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def _greedy(target, prompt_ids, n):
    return SpeculativeGenerator(target).generate([prompt_ids], SamplingParams(0.0, max_new_tokens=n))[0].output_ids


def _chat_ids(tokenizer, messages, **kwargs):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


# ================================================================ chat template, defaults, max_tokens
def test_chat_template_kwargs_reach_the_template(client, target):
    messages = [{"role": "user", "content": "Count: one two three"}]
    plain = _chat_ids(target.tokenizer, messages)
    no_think = _chat_ids(target.tokenizer, messages, enable_thinking=False)
    assert len(no_think) > len(plain)  # the template does read the switch
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert resp.usage.prompt_tokens == len(no_think)
    assert resp.choices[0].message.content == target.tokenizer.decode(_greedy(target, no_think, 12),
                                                                      skip_special_tokens=True)
    default = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert default.usage.prompt_tokens == len(plain)  # negative control: without the kwargs, thinking stays on
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.tokenize"):
        client.chat.completions.create(model=MODEL, messages=messages,
                                       extra_body={"chat_template_kwargs": {"tokenize": False}})


def test_generation_config_supplies_omitted_sampling_fields(client, target, tmp_path):
    prompt = "The weather today is"
    ids = target.tokenizer.encode(prompt)
    greedy = _greedy(target, ids, 10)
    # generation_config.json says temperature 0: a request without temperature decodes greedily
    omitted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                        extra_body={"return_token_ids": True})
    assert omitted.choices[0].model_extra["token_ids"] == greedy
    sampled = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=s,
                                         extra_body={"return_token_ids": True, "top_k": 0}) for s in range(3)]
    assert any(r.choices[0].model_extra["token_ids"] != greedy for r in sampled)  # negative control: T=1 samples

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": -1}))
    assert SamplingDefaults.from_folder(tmp_path) == SamplingDefaults(0.6, 0.95, 0, None)
    assert SamplingDefaults.from_folder(tmp_path / "missing") == SamplingDefaults()


def test_max_tokens_defaults_to_the_rest_of_the_context(client, target):
    prompt_ids = target.tokenizer.encode("Tell me a story")
    resp = client.completions.create(model=MODEL, prompt=prompt_ids, temperature=0)
    assert resp.usage.completion_tokens == CONTEXT - len(prompt_ids)
    assert resp.choices[0].finish_reason == "length"


def test_default_max_tokens_flag_is_a_cap(target):
    with ServerThread(_app(target, default_max_tokens=5)) as srv:
        body = {"prompt": "Tell me a story", "temperature": 0}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 5
        body["max_tokens"] = 9  # an explicit max_tokens is not capped
        assert httpx.post(f"{srv.url}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 9


# ================================================================ request fields
NON_NEUTRAL = {"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 3, "ignore_eos": True, "logprobs": 1,
               "top_logprobs": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5, "best_of": 2, "echo": True,
               "use_beam_search": True, "length_penalty": 0.8, "spaces_between_special_tokens": False,
               "include_reasoning": False, "tool_choice": "required", "priority": 1, "modalities": ["audio"],
               "response_format": {"type": "json_object"}, "logit_bias": {"5": 10}, "suffix": "end",
               "store": True, "function_call": "auto"}


def _refused(table):
    return sorted(name for name, neutral in table.items() if neutral is not ANY)


@pytest.mark.parametrize("path, table, base", [
    ("completions", COMPLETION_UNSUPPORTED, {"prompt": "hi", "max_tokens": 2}),
    ("chat/completions", CHAT_UNSUPPORTED, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_every_unimplemented_vllm_field_is_refused_by_name(server, path, table, base):
    for field in ("repetition_penalty", "min_p", "min_tokens", "ignore_eos", "guided_json", "logits_processors"):
        assert field in table  # the fields users reach for first
    for field in _refused(table):
        resp = httpx.post(f"{server.url}/v1/{path}", json={**base, field: NON_NEUTRAL.get(field, "x")})
        assert resp.status_code == 400, (field, resp.text)
        assert resp.json()["error"]["param"] == field and field in resp.json()["error"]["message"]
    neutral = {name: ("anything" if values is ANY else values[-1]) for name, values in table.items()}
    ok = httpx.post(f"{server.url}/v1/{path}", json={**base, **neutral})
    assert ok.status_code == 200, ok.text  # every field at its neutral value is accepted at once
    unknown = httpx.post(f"{server.url}/v1/{path}", json={**base, "max_token": 5})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "max_token"


def test_refusal_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"repetition_penalty": 1.1})
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          frequency_penalty=0, presence_penalty=0, user="me",
                                          extra_body={"repetition_penalty": 1.0, "min_p": 0.0})
    assert resp.choices[0].finish_reason == "length"


def test_truncate_prompt_tokens_and_request_id(client):
    resp = client.completions.create(model=MODEL, prompt=REPEATING, max_tokens=2, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 5, "request_id": "abc"})
    assert resp.usage.prompt_tokens == 5 and resp.id == "cmpl-abc"


# ================================================================ stop strings and usage
def test_usage_ends_at_the_stop_string(client, target):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    ids, text = full.model_extra["token_ids"], full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and len(ids) == 40
    cut = text[: text.index(stop)]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                     extra_body={"return_token_ids": True})
    n = resp.usage.completion_tokens
    decode = lambda k: target.tokenizer.decode(ids[:k], skip_special_tokens=True)  # noqa: E731
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["token_ids"] == ids[:n]
    assert decode(n).startswith(cut) and len(decode(n - 1).rstrip("\ufffd")) < len(cut)  # the shortest such prefix
    assert n < 40
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == n
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    with_stop = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                          extra_body={"include_stop_str_in_output": True})
    assert with_stop.choices[0].text == cut + stop


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model=MODEL, prompt=REPEATING, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 12 == chunks[-1].usage.completion_tokens


# ================================================================ metrics
def test_vllm_metrics(target):
    self_drafter = DraftModelDrafter(target.model, target.vocab_size, 4)  # the target drafts: greedy accepts all
    with ServerThread(_app(target, self_drafter)) as srv:
        for _ in range(3):
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": REPEATING, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200
        text = httpx.get(f"{srv.url}/metrics").text
    s = parse_prometheus(text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "dspark_acceptance_length"):
        assert any(n == name for n, _ in s), name
    assert metric_sum(s, "vllm:time_to_first_token_seconds_count") == 3
    assert metric_sum(s, "vllm:e2e_request_latency_seconds_count") == 3
    # every token after the first of each request observes one inter-token latency
    assert metric_sum(s, "vllm:time_per_output_token_seconds_count") == 3 * 23
    assert metric_sum(s, "vllm:request_generation_tokens_sum") == 3 * 24
    assert metric_sum(s, "vllm:request_success_total", finished_reason="length") == 3
    accepted = metric_sum(s, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    assert accepted == metric_sum(s, "dspark_accepted_tokens_total")
    assert metric_sum(s, "vllm:spec_decode_num_draft_tokens_total") == metric_sum(s, "dspark_verified_tokens_total")
    per_pos = [metric_sum(s, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(4)]
    drafted = [metric_sum(s, "dspark_spec_decode_num_draft_tokens_per_pos_total", position=str(k)) for k in range(4)]
    assert sum(per_pos) == accepted and sum(drafted) == metric_sum(s, "dspark_verified_tokens_total")
    assert per_pos == sorted(per_pos, reverse=True) and all(a <= d for a, d in zip(per_pos, drafted))
    with pytest.raises(ValueError):
        parse_prometheus("this is { not prometheus")


# ================================================================ incremental detokenisation
class _SlowTokenizer:
    """The SmolLM2 tokenizer without its fast backend (the window path), recording decode lengths."""

    def __init__(self, tok) -> None:
        self.tok, self.lengths = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _token_soups(tok, count=30, seed=0):
    rng = random.Random(seed)
    text = tok.encode("héllo wörld, 你好世界 🎉🎉 naïve café. stop here please; done")
    for i in range(count):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        yield text + ids if i % 2 else ids + text


@pytest.mark.parametrize("slow", [False, True])
def test_incremental_decoding_equals_whole_decoding(tokenizer, slow):
    tok = _SlowTokenizer(tokenizer) if slow else tokenizer
    for ids in _token_soups(tokenizer):
        decoder = IncrementalDecoder(tok)
        assert (decoder._stream is None) == slow
        out = "".join(decoder.step(t) for t in ids) + decoder.flush()
        assert out == tokenizer.decode(ids, skip_special_tokens=True)
    if slow:  # a window, never the whole output: 300 tokens decode at most a few at a time
        tok.lengths.clear()
        decoder = IncrementalDecoder(tok)
        for t in tokenizer.encode("word " * 300):
            decoder.step(t)
        assert max(tok.lengths) <= IncrementalDecoder.WINDOW + 1


@pytest.mark.parametrize("slow", [False, True])
def test_stop_strings_on_incremental_text(tokenizer, slow):
    """Against the whole-text reference: the text before the first stop string, in any chunking."""
    tok = _SlowTokenizer(tokenizer) if slow else tokenizer
    rng = random.Random(1)
    for ids in _token_soups(tokenizer, 20, seed=2):
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        for stops in (["stop here"], ["🎉", "café"], ["d, 你"], ["not in there"]):
            stream = TextStream(tok, stops)
            out, i = "", 0
            while i < len(ids) and not stream.stopped:
                k = rng.randrange(1, 6)
                out += stream.add(ids[i : i + k])
                i += k
            out += stream.flush()
            hits = [whole.find(s) for s in stops if s in whole]
            assert out == (whole[: min(hits)] if hits else whole), (stops, whole)
            assert stream.stopped == bool(hits)
            if hits and out:
                n = stream.num_tokens
                assert tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(out)
                shorter = tokenizer.decode(ids[: n - 1], skip_special_tokens=True).rstrip("\ufffd")  # whole chars
                assert len(shorter) < len(out)


def test_special_tokens_kept_on_request(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    kept = TextStream(tokenizer, [], skip_special_tokens=False)
    assert kept.add(ids) + kept.flush() == tokenizer.decode(ids, skip_special_tokens=False)
    skipped = TextStream(tokenizer, [])
    assert skipped.add(ids) + skipped.flush() == "hi there"
