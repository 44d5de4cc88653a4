"""Regeneration through any OpenAI-compatible server (vLLM, SGLang, `dspark serve`).

Each turn is one ``POST {base_url}/chat/completions`` with the conversation so far, the turn's seed
(fixed by (seed, line, turn), as in process), the sampling settings and ``chat_template_kwargs``
(``{"enable_thinking": false}``, rendered in process too); ``top_k`` and ``chat_template_kwargs`` are
extensions that vLLM, SGLang and `dspark serve` take. ``concurrency`` conversations are in flight; the server
batches them. The records are the in-process path's (``regenerate_io``); with greedy decoding and
`dspark serve` on the same target they are equal to them.

Failures: a connection error, a timeout, 429 or 5xx is retried with exponential backoff; after the
last try the run stops with one line naming the server and the cause, and every record finished so
far stays written (rerun the same command to resume). 400/413/422 (prompt too long for the server's
context, ...) fail that record only, into ``<out>_error.jsonl``; 401/403/404 (key, model, URL) stop
at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dspark.data.regenerate_io import (CHAT_TEMPLATE_KWARGS, RecordWriter, RegenerateStats, Reply, plan,
                                       run_conversations)
from dspark.errors import DSparkError, PromptError


class ServerError(DSparkError):
    """The server could not be reached or kept failing; the run stops (records so far are kept)."""


@dataclass
class RetryPolicy:
    retries: int = 5  # tries after the first one
    backoff_s: float = 1.0  # wait before the first retry; doubles each time
    max_backoff_s: float = 30.0
    timeout_s: float = 600.0  # one request, connect to last byte

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0:
            raise DSparkError(f"bad retry settings {self}: retries and backoff must be >= 0, timeout > 0")

    def wait(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1-based)."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


_RECORD_ERRORS = (400, 413, 422)  # this conversation cannot be answered: fail the record, keep going


def api_base(base_url: str) -> str:
    """The OpenAI base URL: ``http://host:8000`` and ``http://host:8000/v1`` both give ``.../v1``."""
    url = httpx.URL(base_url.rstrip("/"))
    if url.scheme not in ("http", "https") or not url.host:
        raise DSparkError(f"--base-url {base_url!r} is not an http(s) URL; write it as http://HOST:PORT/v1")
    return str(url if url.path not in ("", "/") else url.copy_with(path="/v1"))


def _server_message(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return resp.text[:200] or resp.reason_phrase


class HttpTurns:
    """Answers turns with chat completions from one server, retrying what a retry can fix."""

    def __init__(self, client: httpx.AsyncClient, model: str | None, max_new_tokens: int, temperature: float,
                 top_p: float, top_k: int, retry: RetryPolicy) -> None:
        self.client = client
        self.model = model
        self.sampling = dict(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        self.retry = retry

    def url(self, path: str) -> str:
        return str(self.client.base_url).rstrip("/") + path

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON answer; PromptError for a request this conversation got wrong, ServerError otherwise."""
        where = self.url(path)
        for attempt in range(self.retry.retries + 1):
            if attempt:
                await asyncio.sleep(self.retry.wait(attempt))
            try:
                resp = await self.client.request(method, path, json=body)
            except httpx.TransportError as err:  # refused, reset, timed out, ...
                cause = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                cause = f"HTTP {resp.status_code}: {_server_message(resp)}"
                continue
            if resp.status_code in _RECORD_ERRORS:
                raise PromptError(f"the server refused the turn (HTTP {resp.status_code}): {_server_message(resp)}")
            if resp.status_code >= 400:
                raise ServerError(f"{method} {where}: HTTP {resp.status_code}: {_server_message(resp)}")
            try:
                return resp.json()
            except ValueError:
                raise ServerError(f"{method} {where} did not answer JSON: {resp.text[:200]!r}") from None
        raise ServerError(f"{method} {where} failed {self.retry.retries + 1} times; last: {cause}")

    async def resolve_model(self) -> str:
        """``--model``, else the first model the server lists."""
        if self.model is None:
            models = (await self.request("GET", "/models")).get("data") or []
            if not models:
                raise ServerError(f"{self.url('/models')} lists no model; pass --model")
            self.model = str(models[0]["id"])
        return self.model

    async def __call__(self, messages: list[dict[str, str]], seed: int) -> Reply:
        body = {"model": self.model, "messages": messages, "seed": seed, "n": 1, **self.sampling,
                "chat_template_kwargs": dict(CHAT_TEMPLATE_KWARGS)}
        answer = await self.request("POST", "/chat/completions", body)
        try:
            choice = answer["choices"][0]
            text = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ServerError(f"{self.url('/chat/completions')} answered without a message: "
                              f"{str(answer)[:200]}") from None
        usage = answer.get("usage") or {}
        return Reply(text, int(usage.get("completion_tokens") or 0))


def regenerate_over_http(
    base_url: str,
    prompts_jsonl: str | Path,
    out_jsonl: str | Path,
    api_key: str | None = None,
    model: str | None = None,
    concurrency: int = 16,
    max_new_tokens: int = 1024,
    temperature: float = 0.7,
    top_p: float = 0.8,
    top_k: int = 20,
    seed: int = 0,
    limit: int | None = None,
    shard: tuple[int, int] | None = None,
    progress: bool = True,
    retry: RetryPolicy | None = None,
    transport: httpx.AsyncBaseTransport | None = None,  # tests: httpx.MockTransport
) -> RegenerateStats:
    """``regenerate`` with a server answering the turns; the same records, resume and error file."""
    if concurrency < 1:
        raise DSparkError(f"--concurrency must be >= 1, got {concurrency}")
    retry = retry or RetryPolicy()
    out_jsonl = Path(out_jsonl)
    base = api_base(base_url)
    work = plan(Path(prompts_jsonl), out_jsonl, limit, shard)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def run(writer: RecordWriter) -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=retry.timeout_s, limits=limits,
                                     transport=transport) as client:
            answer = HttpTurns(client, model, max_new_tokens, temperature, top_p, top_k, retry)
            if work.todo:
                await answer.resolve_model()
            await run_conversations(answer, work.todo, seed, concurrency, writer.done)

    try:
        with RecordWriter(out_jsonl, work, progress) as writer:
            asyncio.run(run(writer))
    except ServerError as err:
        s = work.stats
        raise ServerError(f"{err}. {s.skipped + s.succeeded} records are in {out_jsonl} and kept; "
                          "rerun the same command to resume") from None
    return work.stats
