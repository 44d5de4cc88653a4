"""Every user-controlled input is bounded: stop strings (count, length, a linear hold-back),
chat_template_kwargs (reserved names refused), stop_token_ids, each refused with a 400 naming the field.

Target: a tiny random model with SmolLM2's vocabulary behind the real SmolLM2 tokenizer and chat template.
"""

from __future__ import annotations

import random

import httpx
import pytest

from dspark.serving.engine import Engine, EngineConfig
from dspark.serving.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from dspark.serving.prompts import RESERVED_TEMPLATE_NAMES, reserved_template_names
from dspark.serving.server import ServerConfig, ServerThread, create_app
from dspark.serving.text import StopMatcher, TextStream
from tests.tiny import tiny_smollm2_target

KEY = "sk-bounded"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def target():
    return tiny_smollm2_target()


@pytest.fixture(scope="module")
def server(target):
    engine = Engine(target, None, None, EngineConfig(max_batch=2, max_queue=4))
    app = create_app(engine, target.tokenizer, ServerConfig(model_name="tiny", api_key=KEY, default_max_tokens=4))
    with ServerThread(app) as srv:
        yield srv


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, headers=AUTH, timeout=60)


# ---------------------------------------------------------------- the hold-back
def _reference_hold(text: str, stops: list[str]) -> tuple[int, int]:
    """The quadratic definition: (first stop index or -1, longest end of text that starts a stop string)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return (min(found) if found else -1), hold


def test_stop_matcher_agrees_with_the_definition():
    rng = random.Random(0)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        matchers = [StopMatcher(s) for s in stops]
        text = ""
        while len(text) < 30:
            start, text = len(text), text + "".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
            found = [i for i in (m.feed(text, start) for m in matchers) if i >= 0]
            where, hold = _reference_hold(text, stops)
            if where >= 0:
                assert found and min(found) == where, (text, stops)
                break
            assert not found and max(m.partial for m in matchers) == hold, (text, stops)


def test_stop_matcher_negative_control_a_matcher_without_failure_links_misses():
    """The check above can fail: a matcher that restarts at 0 on a mismatch (no KMP table) misses 'aab' in 'aaab'."""

    class Restarting(StopMatcher):
        def __init__(self, stop):
            super().__init__(stop)
            self._fail = [0] * len(stop)

    assert StopMatcher("aab").feed("aaab", 0) == 1
    assert Restarting("aab").feed("aaab", 0) == -1


def test_a_long_stop_string_over_a_long_text_is_linear(target):
    """MAX_STOP_CHARS 'q's against a text of 'q's (the issue's worst case, 1 character short of matching):
    the matcher looks at each character a bounded number of times (counted, not timed)."""
    stop = "q" * MAX_STOP_CHARS + "!"
    matcher = StopMatcher(stop)
    looks = 0

    class Counting(list):  # counts the failure-table look-ups: the only work beyond one step per character
        def __getitem__(self, i):
            nonlocal looks
            looks += 1
            return list.__getitem__(self, i)

    matcher._fail = Counting(matcher._fail)
    full = "q" * (4 * MAX_STOP_CHARS)
    for end in range(7, len(full) + 7, 7):  # fed a few characters at a time, as a stream is
        assert matcher.feed(full[:end], end - 7) == -1
    assert looks <= len(full) and matcher.partial == MAX_STOP_CHARS
    ids = target.tokenizer.encode("q" * 3000)
    stream = TextStream(target.tokenizer, [stop])
    out = "".join(stream.add([t]) for t in ids)
    assert not stream.stopped and len(out) == 3000 - MAX_STOP_CHARS  # the rest is held back
    assert out + stream.flush() == target.tokenizer.decode(ids)


# ---------------------------------------------------------------- stop limits over HTTP
@pytest.mark.parametrize("stop, param, code", [
    (["x"] * (MAX_STOP_STRINGS + 1), "stop", "too_many_stop_strings"),
    ("q" * (MAX_STOP_CHARS + 1), "stop", "stop_string_too_long"),
    (["ok", "q" * 1_000_000], "stop[1]", "stop_string_too_long"),
])
def test_stop_limits_are_400s_naming_the_limit(server, stop, param, code):
    resp = _post(server, "completions", {"prompt": "hi", "max_tokens": 2, "stop": stop})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == code
    assert str(MAX_STOP_STRINGS if code == "too_many_stop_strings" else MAX_STOP_CHARS) in error["message"]


def test_stops_at_the_limits_are_accepted(server):
    stops = ["\x00" * MAX_STOP_CHARS] + ["\x01"] * (MAX_STOP_STRINGS - 1)
    resp = _post(server, "completions", {"prompt": "hi", "max_tokens": 3, "stop": stops})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


def test_stop_token_ids_are_bounded(server):
    over = _post(server, "completions", {"prompt": "hi", "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)})
    assert over.status_code == 400 and over.json()["error"]["param"] == "stop_token_ids"
    at = _post(server, "completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [3] * MAX_STOP_TOKEN_IDS})
    assert at.status_code == 200


# ---------------------------------------------------------------- chat_template_kwargs
def test_reserved_names_cover_what_the_template_render_binds(target):
    names = reserved_template_names(target.tokenizer)
    assert RESERVED_TEMPLATE_NAMES <= names
    assert {"tokenize", "bos_token", "eos_token"} <= names  # apply_chat_template's own, and a special token


@pytest.mark.parametrize("key", ["messages", "tools", "documents", "add_generation_prompt", "tokenize",
                                 "raise_exception", "strftime_now", "bos_token", "eos_token", "conversation"])
def test_reserved_chat_template_kwargs_are_400s_naming_the_key(server, key):
    resp = _post(server, "chat/completions", {**CHAT, "chat_template_kwargs": {key: 1}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == f"chat_template_kwargs.{key}" and error["code"] == "reserved_template_kwarg"
    assert key in error["message"]


def test_ordinary_chat_template_kwargs_still_work(server):
    for kwargs in ({"enable_thinking": False}, {"custom_flag": [1, {"a": "b"}]}, {}):
        resp = _post(server, "chat/completions", {**CHAT, "chat_template_kwargs": kwargs})
        assert resp.status_code == 200, resp.text
    bad = _post(server, "chat/completions", {**CHAT, "chat_template_kwargs": {"not a name": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_cli_body_limit_default_matches_the_library():
    from dspark.serving import cli, limits

    assert cli.DEFAULT_MAX_BODY_BYTES == limits.DEFAULT_MAX_BODY_BYTES


def test_huge_text_prompts_are_refused_before_tokenising(server, target):
    """A text longer than (longest token) x (prompt limit) characters cannot fit: 400 without tokenising."""
    from dspark.serving.prompts import max_token_chars

    chars = max_token_chars(target.tokenizer) * target.max_context + 1
    text = _post(server, "completions", {"prompt": "a" * chars})
    assert text.status_code == 400 and "characters" in text.json()["error"]["message"]
    chat = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "a" * chars}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "prompt_too_long"
    many = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "a"}] * (target.max_context + 1)})
    assert many.status_code == 400 and many.json()["error"]["param"] == "messages"
    # just under the character bound the prompt is tokenised and judged on its real length
    under = _post(server, "completions", {"prompt": "a" * (chars - 1)})
    assert under.status_code == 400 and "characters" not in under.json()["error"]["message"]
