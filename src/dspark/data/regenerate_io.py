"""What every regeneration path shares: records in and out, resume, per-turn seeds, the conversation driver.

A path (the engine in this process, an OpenAI-compatible server, the old static batches) only
answers one assistant turn; ``run_conversations`` walks each conversation's user turns in order,
each turn seeing the regenerated history, with ``concurrency`` conversations in flight, and
``RecordWriter`` writes finished records in input order (so a seed reproduces the file byte for
byte, whatever the batching) to ``out`` and failures to ``<out>_error.jsonl``.

Errors: a ``PromptError`` from a path fails that record only (it goes to the error file); any other
exception ends the run after every finished record is written, so rerunning resumes.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.errors import DSparkError, PromptError

#: turn seeds are ``seed + SEED_LINE_STRIDE * line + turn``: fixed by (seed, line, turn), never by the batching
SEED_LINE_STRIDE = 100_003

#: template variables every path renders each turn with, as DeepSpec's data script sends them
#: (docs/interop.md §Training data files): a template that reads ``enable_thinking`` (Qwen3) answers without a
#: thinking block, on the first turn as on later ones; the others ignore it
CHAT_TEMPLATE_KWARGS = {"enable_thinking": False}


@dataclass
class RegenerateStats:
    total: int = 0  # records in the input
    skipped: int = 0  # already in the output (resume)
    succeeded: int = 0
    failed: int = 0
    new_tokens: int = 0


@dataclass
class Reply:
    text: str  # the assistant message, stop token removed
    new_tokens: int  # tokens generated for it (stop token included)


#: answers one assistant turn: (messages so far, ending with the user turn; seed) -> Reply.
#: Raises PromptError when this record cannot be answered (too long, no chat template, ...).
AnswerTurn = Callable[[list[dict[str, str]], int], Awaitable[Reply]]


def turn_seed(seed: int, line: int, turn: int) -> int:
    return seed + SEED_LINE_STRIDE * line + turn


def error_path(out_jsonl: Path) -> Path:
    out_jsonl = Path(out_jsonl)
    return out_jsonl.with_name(f"{out_jsonl.stem}_error.jsonl")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DSparkError(f"{path}:{n} is not valid JSON ({err})") from None
            if not isinstance(rec, dict):
                raise DSparkError(f"{path}:{n}: expected a JSON object per line")
            records.append(rec)
    return records


def done_ids(out_jsonl: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is cut off."""
    if not out_jsonl.exists():
        return set()
    data = out_jsonl.read_bytes()
    good_end, ids = 0, set()
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            break
        good_end += len(line)
    if good_end < len(data):
        os.truncate(out_jsonl, good_end)
    return ids


def split_conversation(rec: dict[str, Any]) -> tuple[list[dict[str, str]], list[str]]:
    """(system messages, user turns) of a record; assistant turns are dropped."""
    if "conversations" in rec:
        msgs = rec["conversations"]
        system = [{"role": "system", "content": m["content"]} for m in msgs if m.get("role") == "system"]
        users = [m["content"] for m in msgs if m.get("role") == "user"]
    elif "turns" in rec:
        system, users = [], [str(t) for t in rec["turns"]]
    else:
        raise PromptError("record has neither 'conversations' nor 'turns'")
    if not users:
        raise PromptError("record has no user turn")
    return system, users


@dataclass
class Job:
    """One conversation being regenerated."""

    line: int  # index in the input file (seeds, output order)
    rec: dict[str, Any]
    history: list[dict[str, str]]
    users: list[str]
    error: str | None = None
    new_tokens: int = 0

    @classmethod
    def from_record(cls, line: int, rec: dict[str, Any]) -> "Job":
        try:
            system, users = split_conversation(rec)
            return cls(line, rec, list(system), users)
        except (PromptError, KeyError, TypeError, AttributeError) as err:
            return cls(line, rec, [], [], error=f"bad record: {err}")


@dataclass
class Plan:
    """The input records still to do, after ``--limit`` and resume."""

    todo: list[tuple[int, dict[str, Any]]]  # (line, record with its id)
    stats: RegenerateStats


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """`K/N` (0 <= K < N): this process answers the lines L with L % N == K."""
    if not spec:
        return None
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise DSparkError(f"bad --shard {spec!r}: write K/N with 0 <= K < N, e.g. 0/2 and 1/2 for two processes")
    return k, n


def merge_shards(prompts_jsonl: Path, shard_files: list[Path], out_jsonl: Path) -> int:
    """Write the records of `--shard` runs to `out_jsonl` (atomically) in the prompt file's order. Refuses a prompt
    with no record (a shard unfinished) or a record of no prompt; returns the number of records."""
    if not prompts_jsonl.exists():
        raise DSparkError(f"{prompts_jsonl} not found: give the prompt file the shards answered (--prompts)")
    order = [str(rec.get("id", line)) for line, rec in enumerate(read_jsonl(prompts_jsonl))]
    by_id: dict[str, bytes] = {}
    for path in shard_files:
        if not path.exists():
            raise DSparkError(f"{path}: no such shard output")
        lines = path.read_bytes().splitlines(keepends=True)
        if lines and not lines[-1].endswith(b"\n"):  # torn by a kill: that record is missing (the run resumes it)
            lines.pop()
        for line_no, raw in enumerate(lines, 1):
            try:
                by_id[str(json.loads(raw)["id"])] = raw
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DSparkError(f"{path}:{line_no}: not a regenerated record ({err})") from err
    missing = [i for i in order if i not in by_id]
    if missing:
        raise DSparkError(f"{len(missing)} of {len(order)} prompts of {prompts_jsonl} have no record in the shards "
                          f"(first: {missing[0]}); finish the shard runs first (the same commands resume)")
    extra = set(by_id) - set(order)
    if extra:
        raise DSparkError(f"{len(extra)} shard records are not prompts of {prompts_jsonl} (first: {sorted(extra)[0]})")
    tmp = out_jsonl.with_name(out_jsonl.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(by_id[i] for i in order)
    os.replace(tmp, out_jsonl)
    return len(order)


def plan(prompts_jsonl: Path, out_jsonl: Path, limit: int | None, shard: tuple[int, int] | None = None) -> Plan:
    if not prompts_jsonl.exists():
        raise DSparkError(f"{prompts_jsonl} not found; build prompts with `dspark data prompts` first")
    records = read_jsonl(prompts_jsonl)
    if limit is not None:
        records = records[:limit]
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    done = done_ids(out_jsonl)
    if shard is not None:  # seeds stay fixed by the line in the whole file: the shards' union is the unsharded run
        records = [rec if line % shard[1] == shard[0] else None for line, rec in enumerate(records)]
    stats = RegenerateStats(total=sum(rec is not None for rec in records))
    todo = []
    for line, rec in enumerate(records):
        if rec is None:
            continue
        if str(rec.get("id", line)) in done:
            stats.skipped += 1
        else:
            todo.append((line, {**rec, "id": rec.get("id", line)}))
    return Plan(todo, stats)


class RecordWriter:
    """Writes finished jobs in input order (later ones wait in memory); ``close`` writes whatever is left."""

    def __init__(self, out_jsonl: Path, plan_: Plan, progress: bool) -> None:
        from tqdm.auto import tqdm

        self.stats = plan_.stats
        self._order = [line for line, _ in plan_.todo]
        self._next = 0  # index into _order of the next record to write
        self._ready: dict[int, Job] = {}
        self._out = open(out_jsonl, "a")
        self._err = open(error_path(out_jsonl), "w")  # failures are retried on a rerun: the file is rewritten
        self._bar = tqdm(total=self.stats.total, initial=self.stats.skipped, desc="regenerate", unit="conv",
                         disable=not progress, dynamic_ncols=True)

    def done(self, job: Job) -> None:
        self._ready[job.line] = job
        while self._next < len(self._order) and self._order[self._next] in self._ready:
            self._write(self._ready.pop(self._order[self._next]))
            self._next += 1
        self._out.flush()
        self._err.flush()

    def _write(self, job: Job) -> None:
        if job.error is None:
            self._out.write(json.dumps({**job.rec, "conversations": job.history, "status": "success"}) + "\n")
            self.stats.succeeded += 1
            self.stats.new_tokens += job.new_tokens
        else:
            self._err.write(json.dumps({**job.rec, "status": "error", "error": job.error}) + "\n")
            self.stats.failed += 1
        self._bar.update(1)
        self._bar.set_postfix(ok=self.stats.succeeded, failed=self.stats.failed, new_tokens=self.stats.new_tokens)

    def close(self) -> None:
        """Write the finished jobs still waiting for an earlier one (the run is ending): resume skips them."""
        for line in sorted(self._ready):
            self._write(self._ready.pop(line))
        self._out.close()
        self._err.close()
        self._bar.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def answer_conversation(answer: AnswerTurn, job: Job, seed: int) -> Job:
    """Every user turn of ``job`` in order, each seeing the regenerated history."""
    for turn, user in enumerate(job.users):
        if job.error is not None:
            break
        messages = job.history + [{"role": "user", "content": user}]
        try:
            reply = await answer(messages, turn_seed(seed, job.line, turn))
        except PromptError as err:
            job.error = str(err)
            break
        job.history = messages + [{"role": "assistant", "content": reply.text}]
        job.new_tokens += reply.new_tokens
    return job


async def run_conversations(answer: AnswerTurn, todo: list[tuple[int, dict[str, Any]]], seed: int,
                            concurrency: int, on_done: Callable[[Job], None]) -> None:
    """``concurrency`` workers take the next conversation as soon as theirs is done; the first
    exception other than a record's PromptError cancels the rest and is raised."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = iter(todo)

    async def worker() -> None:
        for line, rec in pending:
            on_done(await answer_conversation(answer, Job.from_record(line, rec), seed))

    tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, max(len(todo), 1)))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
