"""Regenerate the assistant turns of training prompts with the target itself (docs/conventions.md §Data, docs/interop.md §Training data files).

The drafter should learn the target's own distribution, so every user turn is
re-answered by the target, in order, each turn seeing the regenerated history.
System messages are kept, original assistant turns dropped. Sampling defaults
follow DeepSpec's data script: temperature 0.7, top_p 0.8, top_k 20.

Input: JSONL records with ``conversations`` ([{"role", "content"}]) or
``turns`` (list of user messages); ``id`` if present (else the line number).
Output: the same record with the new ``conversations`` and ``"status": "success"``;
a record that fails (prompt too long, no chat template for a multi-turn
conversation, ...) goes to ``<out>_error.jsonl`` with ``status`` and ``error``.
Rerunning the same command skips ids already in the output (resume) and retries
the failures (the error file is rewritten).

Requests are decoded as a static batch by ``SpeculativeGenerator`` with no
drafter (plain target sampling); one request's seed is fixed by (seed, line, turn).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.errors import DSparkError, PromptError
from dspark.target.model import TargetModel


@dataclass
class RegenerateStats:
    total: int = 0  # records in the input
    skipped: int = 0  # already in the output (resume)
    succeeded: int = 0
    failed: int = 0
    new_tokens: int = 0


def error_path(out_jsonl: Path) -> Path:
    out_jsonl = Path(out_jsonl)
    return out_jsonl.with_name(f"{out_jsonl.stem}_error.jsonl")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
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


def _done_ids(out_jsonl: Path) -> set[str]:
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


def encode_conversation(target: TargetModel, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids for the next assistant turn."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return target.encode_chat(messages[0]["content"])
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise PromptError("a multi-turn or system-prompt conversation needs a tokenizer with a chat template")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


@dataclass
class _Job:
    line: int  # index in the input file (seeds)
    rec: dict[str, Any]
    history: list[dict[str, str]]
    users: list[str]
    error: str | None = None
    new_tokens: int = 0


def _decode_reply(target: TargetModel, output_ids: list[int], finish_reason: str) -> str:
    if finish_reason == "stop" and output_ids:
        output_ids = output_ids[:-1]  # the stop token
    return target.tokenizer.decode(output_ids, skip_special_tokens=True)


def _run_turn(target: TargetModel, jobs: list[_Job], turn: int, max_new_tokens: int,
              temperature: float, top_p: float, top_k: int, seed: int) -> None:
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    prompts, params, live = [], [], []
    for job in jobs:
        if job.error is not None or turn >= len(job.users):
            continue
        msgs = job.history + [{"role": "user", "content": job.users[turn]}]
        try:
            ids = encode_conversation(target, msgs)
            target.check_prompt(ids)
            budget = min(max_new_tokens, target.max_context - len(ids))
            if budget < 1:
                raise PromptError(f"the prompt fills the model's context of {target.max_context} tokens")
        except PromptError as err:
            job.error = str(err)
            continue
        job.history = msgs
        prompts.append(ids)
        params.append(SamplingParams(temperature, top_k, top_p, budget, seed=seed + 100_003 * job.line + turn))
        live.append(job)
    if not live:
        return
    results = SpeculativeGenerator(target).generate(prompts, params, [str(j.line) for j in live])
    for job, res in zip(live, results):
        reply = _decode_reply(target, res.output_ids, res.finish_reason)
        job.history = job.history + [{"role": "assistant", "content": reply}]
        job.new_tokens += len(res.output_ids)


def regenerate(
    target: TargetModel,
    prompts_jsonl: str | Path,
    out_jsonl: str | Path,
    batch_size: int = 8,
    max_new_tokens: int = 1024,
    temperature: float = 0.7,
    top_p: float = 0.8,
    top_k: int = 20,
    seed: int = 0,
    limit: int | None = None,
    progress: bool = True,
) -> RegenerateStats:
    """Re-answer every record's user turns with ``target``; append results to ``out_jsonl``."""
    from tqdm.auto import tqdm

    if target.tokenizer is None:
        raise DSparkError("regeneration needs the target's tokenizer; load the target with tokenizer=True")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts_jsonl, out_jsonl = Path(prompts_jsonl), Path(out_jsonl)
    if not prompts_jsonl.exists():
        raise DSparkError(f"{prompts_jsonl} not found; build prompts with `dspark data prompts` first")
    records = _read_jsonl(prompts_jsonl)
    if limit is not None:
        records = records[:limit]
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out_jsonl)
    stats = RegenerateStats(total=len(records))
    todo = []
    for line, rec in enumerate(records):
        rec_id = str(rec.get("id", line))
        if rec_id in done:
            stats.skipped += 1
            continue
        todo.append((line, {**rec, "id": rec.get("id", line)}))

    bar = tqdm(total=len(records), initial=stats.skipped, desc="regenerate", unit="conv", disable=not progress,
               dynamic_ncols=True)
    try:
        with open(out_jsonl, "a") as out, open(error_path(out_jsonl), "w") as err_out:
            for b in range(0, len(todo), batch_size):
                jobs = []
                for line, rec in todo[b : b + batch_size]:
                    try:
                        system, users = split_conversation(rec)
                        jobs.append(_Job(line, rec, list(system), users))
                    except (PromptError, KeyError, TypeError) as err:
                        jobs.append(_Job(line, rec, [], [], error=f"bad record: {err}"))
                for turn in range(max((len(j.users) for j in jobs), default=0)):
                    _run_turn(target, jobs, turn, max_new_tokens, temperature, top_p, top_k, seed)
                for job in jobs:
                    if job.error is None:
                        out.write(json.dumps({**job.rec, "conversations": job.history, "status": "success"}) + "\n")
                        stats.succeeded += 1
                        stats.new_tokens += job.new_tokens
                    else:
                        err_out.write(json.dumps({**job.rec, "status": "error", "error": job.error}) + "\n")
                        stats.failed += 1
                out.flush()
                err_out.flush()
                bar.update(len(jobs))
                bar.set_postfix(ok=stats.succeeded, failed=stats.failed, new_tokens=stats.new_tokens)
    finally:
        bar.close()
    return stats
