"""The malformed-request corpus of `dspark bench chaos`: bodies, fields, paths, methods and credentials a
careless or hostile client sends. Every case must get an answer in OpenAI's error shape (or a normal answer
when the server may ignore the oddity) and no traceback in the server log.

A case is (category, name, method, path, body, headers); ``body`` is the raw bytes, sent whole or in chunks
without Content-Length. A case with ``raw`` bytes is sent as they are over a socket (HTTP the parser refuses). ``corpus(...)`` builds them for a server with ``api_key`` whose context
is ``context`` tokens, whose vocabulary has ``vocab_size`` ids and whose body limit is ``max_body_bytes``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class Case:
    category: str
    name: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)
    chunked: bool = False  # send the body in pieces without Content-Length
    raw: bytes | None = None  # the whole request as bytes, over a socket

    def chunks(self) -> Iterator[bytes]:
        for i in range(0, len(self.body or b""), 65536):
            yield self.body[i : i + 65536]


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def corpus(api_key: str, context: int, vocab_size: int, max_body_bytes: int) -> list[Case]:
    auth = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    cases: list[Case] = []

    def add(category: str, name: str, body, path: str = COMPLETIONS, method: str = "POST",
            headers: dict | None = None, chunked: bool = False) -> None:
        raw = body if isinstance(body, bytes) or body is None else _j(body)
        cases.append(Case(category, name, method, path, raw, {**auth, **(headers or {})}, chunked))

    # ---- bodies that are not JSON objects
    for name, raw in [
        ("empty", b""), ("truncated", b'{"prompt": "hi"'), ("trailing garbage", b'{"prompt": "hi"} x'),
        ("single quotes", b"{'prompt': 'hi'}"), ("array", b'["hi"]'), ("number", b"42"), ("string", b'"hi"'),
        ("null", b"null"), ("true", b"true"), ("NaN literal", b'{"prompt": "hi", "temperature": NaN}'),
        ("Infinity literal", b'{"prompt": "hi", "temperature": Infinity}'), ("invalid UTF-8", b'{"prompt": "\xff\xfe"}'),
        ("UTF-8 BOM", b'\xef\xbb\xbf{"prompt": "hi"}'), ("UTF-16 body", '{"prompt": "hi"}'.encode("utf-16")),
        ("NUL bytes", b'{"prompt": "hi\x00"}'), ("deep nesting", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("deep objects", b'{"prompt": "hi", "x": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}"),
        ("duplicate keys", b'{"prompt": "hi", "prompt": 5}'), ("bad escape", b'{"prompt": "\\x41"}'),
        ("control char", b'{"prompt": "a\x01b"}'), ("chat truncated", b'{"messages": [{"role": "user"'),
    ]:
        add("bad JSON", name, raw, CHAT if name.startswith("chat") else COMPLETIONS)

    # ---- wrong types, one field at a time
    base = {"prompt": "hello", "max_tokens": 4}
    for fld, values in {
        "prompt": [None, 3.5, True, {"text": "hi"}, [{"a": 1}], [[1, 2], "x"], [None], [1.5, 2]],
        "max_tokens": ["8", 4.5, True, [4], {"n": 4}],
        "temperature": ["hot", [0.5], {"t": 1}, True],
        "top_p": ["0.5", [1]], "top_k": ["5", 2.5, [1]], "seed": ["7", 1.5, [1]],
        "stop": [5, {"s": "x"}, [1, 2], [None], [["x"]]], "stop_token_ids": ["2", [["2"]], [1.5], 7],
        "n": ["1", 1.5], "stream": ["yes", 2, [True]], "stream_options": [[1], "x", 5],
        "model": [5, ["m"], {"id": "m"}], "return_token_ids": ["yes", [1]], "logit_bias": [[1], "x"],
    }.items():
        for v in values:
            add("wrong type", f"{fld}={json.dumps(v)}", {**base, fld: v})
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for name, messages in [
        ("not a list", "hi"), ("dict", {"role": "user", "content": "hi"}), ("strings", ["hi"]), ("numbers", [1, 2]),
        ("null item", [None]), ("no role", [{"content": "hi"}]), ("no content", [{"role": "user"}]),
        ("content int", [{"role": "user", "content": 5}]), ("content dict", [{"role": "user", "content": {"a": 1}}]),
        ("role int", [{"role": 1, "content": "hi"}]), ("role unknown", [{"role": "wizard", "content": "hi"}]),
        ("image part", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        ("part not dict", [{"role": "user", "content": ["hi"]}]), ("empty content", [{"role": "user", "content": " "}]),
        ("empty list", []), ("tool role", [{"role": "tool", "content": "hi", "tool_call_id": "1"}]),
    ]:
        add("wrong type", f"messages {name}", {**chat, "messages": messages}, CHAT)
    add("wrong type", "chat max_completion_tokens str", {**chat, "max_completion_tokens": "4"}, CHAT)
    add("wrong type", "chat tools dict", {**chat, "tools": {"a": 1}}, CHAT)
    add("wrong type", "chat response_format str", {**chat, "response_format": "json"}, CHAT)

    # ---- out-of-range values
    for fld, values in {
        "temperature": [-1, 2.5, 1e308, -1e-9], "top_p": [0, -0.5, 1.5, 1e9], "top_k": [-5, -(2**70)],
        "max_tokens": [0, -1, 10**12, 2**70, context], "seed": [-1, 2**70, -(2**70)], "n": [0, -1, 2, 10**9],
        "stop": [["x"] * 100, ["y" * 100_000]], "stop_token_ids": [[-1], [vocab_size], [2**70], list(range(20_000))],
    }.items():
        for v in values:
            add("out of range", f"{fld}={json.dumps(v)[:40]}", {**base, fld: v})
    for name, prompt in [
        ("negative id", [1, -1]), ("id = vocab", [1, vocab_size]), ("id 2^70", [1, 2**70]), ("empty ids", []),
        ("empty string", ""), ("whitespace", "   "), ("over context ids", [5] * (context + 10)),
        ("two prompts", ["a", "b"]), ("empty batch", [[]]), ("id list of lists", [[1, 2], [3]]),
    ]:
        add("out of range", f"prompt {name}", {**base, "prompt": prompt})
    add("out of range", "chat max_completion_tokens 0", {**chat, "max_completion_tokens": 0}, CHAT)
    add("out of range", "chat max_tokens over context", {**chat, "max_tokens": context}, CHAT)
    add("out of range", "model unknown", {**base, "model": "gpt-4"})

    # ---- inputs that could cost the event loop or the engine more than a few milliseconds
    long_stop = min(1_000_000, max_body_bytes - 4096)
    for name, stop in [("one huge", ["q" * long_stop]), ("four large", ["q" * (long_stop // 5)] * 4),
                       ("huge str", "q" * long_stop), ("17 strings", [str(i) for i in range(17)]),
                       ("2049 chars", "a" * 2049)]:
        add("bounded input", f"stop {name}", {**base, "stop": stop})
    add("bounded input", "stop_token_ids 100k", {**base, "stop_token_ids": [3] * 100_000})
    add("bounded input", "n huge", {**base, "n": 10**18})
    add("bounded input", "logit_bias 50k", {**base, "logit_bias": {str(i): 1 for i in range(50_000)}})
    add("bounded input", "chat stop huge", {**chat, "stop": ["q" * long_stop]}, CHAT)
    for key in ("messages", "tools", "documents", "add_generation_prompt", "tokenize", "conversation",
                "raise_exception", "strftime_now", "bos_token", "eos_token", "continue_final_message"):
        add("bounded input", f"chat_template_kwargs {key}", {**chat, "chat_template_kwargs": {key: 1}}, CHAT)
    add("bounded input", "chat_template_kwargs not a dict", {**chat, "chat_template_kwargs": [1]}, CHAT)
    add("bounded input", "chat_template_kwargs bad name", {**chat, "chat_template_kwargs": {"a b": 1}}, CHAT)
    add("bounded input", "chat_template_kwargs many", {**chat, "chat_template_kwargs": {f"k{i}": i for i in
                                                                                       range(20_000)}}, CHAT)

    # ---- OpenAI features the server refuses
    for fld, v in [("logprobs", 3), ("top_logprobs", 2), ("presence_penalty", 0.5), ("frequency_penalty", -1),
                   ("logit_bias", {"5": 10}), ("echo", True), ("best_of", 3), ("suffix", "end")]:
        add("unsupported", fld, {**base, fld: v})
    for fld, v in [("tools", [{"type": "function", "function": {"name": "f"}}]),
                   ("response_format", {"type": "json_object"}), ("logprobs", True), ("n", 3)]:
        add("unsupported", f"chat {fld}", {**chat, fld: v}, CHAT)

    # ---- strings no tokenizer can take (lone UTF-16 surrogates, escaped in JSON)
    for name, raw, path in [
        ("prompt high", b'{"prompt": "abc\\ud800", "max_tokens": 4}', COMPLETIONS),
        ("prompt low", b'{"prompt": "\\udc00abc", "max_tokens": 4}', COMPLETIONS),
        ("prompt list", b'{"prompt": ["\\ud83d"], "max_tokens": 4}', COMPLETIONS),
        ("model", b'{"prompt": "abc", "model": "m\\udfff"}', COMPLETIONS),
        ("stop", b'{"prompt": "abc", "stop": "\\ud800"}', COMPLETIONS),
        ("stop list", b'{"prompt": "abc", "stop": ["ok", "\\udbff"]}', COMPLETIONS),
        ("suffix", b'{"prompt": "abc", "suffix": "\\ud800"}', COMPLETIONS),
        ("unknown field", b'{"prompt": "abc", "max_tokens": 2, "user": "\\ud800"}', COMPLETIONS),
        ("key", b'{"prompt": "abc", "max_tokens": 2, "\\ud800": 1}', COMPLETIONS),
        ("chat content", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', CHAT),
        ("chat role", b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', CHAT),
        ("chat part", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', CHAT),
        ("chat system", b'{"messages": [{"role": "system", "content": "\\ud800"}, '
                        b'{"role": "user", "content": "hi"}]}', CHAT),
        ("chat stop", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', CHAT),
    ]:
        add("lone surrogate", name, raw, path)

    # ---- bodies over the limit, prompts over the context
    over = b'{"prompt": "' + b"x" * (max_body_bytes + 1024) + b'"}'
    add("huge body", "over limit, Content-Length", over)
    add("huge body", "over limit, chunked", over, chunked=True)
    add("huge body", "20 MB", b'{"prompt": "' + b"y" * 20_000_000 + b'"}')
    add("huge body", "over limit, chat", b'{"messages": [{"role": "user", "content": "' + b"z" * (max_body_bytes + 10)
        + b'"}]}', CHAT)
    under = max_body_bytes - 64
    add("huge body", "text prompt under limit", {"prompt": "word " * (under // 5 - 10)})
    add("huge body", "chat under limit", {"messages": [{"role": "user", "content": "a b " * (under // 4 - 20)}]}, CHAT)
    add("huge body", "id prompt under limit", {"prompt": [7] * (under // 3 - 20)})

    # ---- credentials
    for name, value in [("missing", None), ("wrong key", "Bearer nope"), ("basic", f"Basic {api_key}"),
                        ("empty bearer", "Bearer"), ("no scheme", api_key), ("lower-case", f"bearer {api_key}x"),
                        ("very long", "Bearer " + "k" * 6000), ("non-ASCII", "Bearer cl\u00e9".encode("latin-1"))]:
        headers = {"Content-Type": "application/json"}
        if value is not None:
            headers["Authorization"] = value
        cases.append(Case("bad auth", name, "POST", COMPLETIONS, _j(base), headers))
    cases.append(Case("bad auth", "models without key", "GET", "/v1/models", None, {}))

    # ---- wrong paths and methods
    for method, path in [
        ("GET", COMPLETIONS), ("PUT", COMPLETIONS), ("DELETE", COMPLETIONS), ("PATCH", CHAT), ("GET", CHAT),
        ("POST", "/v1/models"), ("POST", "/health"), ("DELETE", "/metrics"), ("POST", "/v2/completions"),
        ("POST", "/v1/completions/"), ("POST", "/v1/embeddings"), ("GET", "/v1/models/other"),
        ("POST", "/v1/../v1/completions"), ("GET", "/%00"), ("GET", "/" + "a" * 8000), ("OPTIONS", COMPLETIONS),
        ("GET", "/v1/completions?prompt=hi"), ("POST", "/v1/chat/completions/x"), ("TRACE", "/health"),
    ]:
        add("wrong path/method", f"{method} {path[:40]}", _j(base) if method in ("POST", "PUT", "PATCH") else None,
            path, method)

    # ---- headers
    add("headers", "text/plain content type", _j(base), headers={"Content-Type": "text/plain"})
    add("headers", "form content type", b"prompt=hi", headers={"Content-Type": "application/x-www-form-urlencoded"})
    add("headers", "gzip claimed", _j(base), headers={"Content-Encoding": "gzip"})
    add("headers", "charset latin-1", _j(base), headers={"Content-Type": "application/json; charset=latin-1"})

    # ---- HTTP the parser refuses (answered by the protocol layer, before the app)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + api_key.encode()
    body = _j(base)
    for name, raw in [
        ("garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello\r\n\r\n"),
        ("no version", b"GET /health\r\n\r\n"), ("bad version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
        ("space in target", b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("header without colon", b"GET /health HTTP/1.1\r\nHost x\r\n\r\n"),
        ("NUL in header", b"GET /health HTTP/1.1\r\nHost: x\x00y\r\n\r\n"),
        ("no Host", b"GET /health HTTP/1.1\r\n\r\n"),
        ("64 kB header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n"),
        ("bad Content-Length", request + b"\r\nContent-Length: abc\r\n\r\n" + body),
        ("negative Content-Length", request + b"\r\nContent-Length: -5\r\n\r\n" + body),
        ("two Content-Lengths", request + b"\r\nContent-Length: 5\r\nContent-Length: 9\r\n\r\n" + body),
        ("bogus Transfer-Encoding", request + b"\r\nTransfer-Encoding: bogus\r\n\r\n" + body),
        ("bad chunk size", request + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n"),
        ("LF only", b"GET /health HTTP/1.1\nHost: x\n\n"),
    ]:
        cases.append(Case("malformed HTTP", name, "", "", raw=raw))
    return cases
