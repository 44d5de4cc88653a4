"""Regenerate the assistant turns of training prompts with the target itself (docs/conventions.md §Data, docs/interop.md §Training data files).

The drafter should learn the target's own distribution, so every user turn is
re-answered by the target, in order, each turn seeing the regenerated history.
System messages are kept, original assistant turns dropped. Sampling defaults
follow DeepSpec's data script: temperature 0.7, top_p 0.8, top_k 20.

Input: JSONL records with ``conversations`` ([{"role", "content"}]) or
``turns`` (list of user messages); ``id`` if present (else the line number).
Output: the same record with the new ``conversations`` and ``"status": "success"``,
in input order; a record that fails (prompt too long, no chat template for a
multi-turn conversation, ...) goes to ``<out>_error.jsonl`` with ``status`` and
``error``. Rerunning the same command skips ids already in the output (resume)
and retries the failures (the error file is rewritten).

Three ways to answer a turn, one record format (``regenerate_io``):

- in process, continuous batching (default, ``regenerate_engine``): the serving
  engine keeps ``batch_size`` requests decoding; a turn joins as another ends;
- in process, static batches (``static_batches=True``, kept to measure against,
  docs/reports/data-throughput.md): ``SpeculativeGenerator`` decodes ``batch_size``
  conversations together, each batch waiting for its longest answer;
- any OpenAI-compatible server (``regenerate_http``).

The in-process paths sample with no drafter, one generator per turn seeded by
(seed, line, turn), so both write the same records whatever the batching.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from dspark.data.regenerate_engine import EngineTurns, decode_reply, encode_conversation, turn_request
from dspark.data.regenerate_io import Job, RecordWriter, RegenerateStats, error_path, plan, run_conversations, turn_seed
from dspark.errors import DSparkError, PromptError
from dspark.target.model import TargetModel

__all__ = ["RegenerateStats", "encode_conversation", "error_path", "regenerate"]


def _static_turn(target: TargetModel, jobs: list[Job], turn: int, max_new_tokens: int,
                 temperature: float, top_p: float, top_k: int, seed: int) -> None:
    """Turn ``turn`` of every live job as one static batch (SpeculativeGenerator, no drafter)."""
    from dspark.generation.generator import SpeculativeGenerator

    prompts, params, live = [], [], []
    for job in jobs:
        if job.error is not None or turn >= len(job.users):
            continue
        msgs = job.history + [{"role": "user", "content": job.users[turn]}]
        try:
            ids, sampling = turn_request(target, msgs, turn_seed(seed, job.line, turn), max_new_tokens,
                                         temperature, top_p, top_k)
        except PromptError as err:
            job.error = str(err)
            continue
        job.history = msgs
        prompts.append(ids)
        params.append(sampling)
        live.append(job)
    if not live:
        return
    results = SpeculativeGenerator(target).generate(prompts, params, [str(j.line) for j in live])
    for job, res in zip(live, results):
        reply = decode_reply(target, res.output_ids, res.finish_reason)
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
    shard: tuple[int, int] | None = None,
    progress: bool = True,
    static_batches: bool = False,
) -> RegenerateStats:
    """Re-answer every record's user turns with ``target``; append results to ``out_jsonl``.

    ``batch_size`` is the engine's active batch (continuous batching), or the size of each static
    batch with ``static_batches``.
    """
    if target.tokenizer is None:
        raise DSparkError("regeneration needs the target's tokenizer; load the target with tokenizer=True")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out_jsonl = Path(out_jsonl)
    work = plan(Path(prompts_jsonl), out_jsonl, limit, shard)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    with RecordWriter(out_jsonl, work, progress) as writer:
        if static_batches:
            for b in range(0, len(work.todo), batch_size):
                jobs = [Job.from_record(line, rec) for line, rec in work.todo[b : b + batch_size]]
                for turn in range(max((len(j.users) for j in jobs), default=0)):
                    _static_turn(target, jobs, turn, seed=seed, **sampling)
                for job in jobs:
                    writer.done(job)
        else:
            with EngineTurns(target, batch_size, **sampling) as answer:
                # twice the batch in flight (EngineTurns sizes its queue for it): a conversation between two
                # turns never leaves a slot idle
                asyncio.run(run_conversations(answer, work.todo, seed, 2 * batch_size, writer.done))
    return work.stats
