"""Training prompts written by the target itself (Magpie: Xu et al., arXiv 2406.08464).

An instruct model rendered up to the start of a user turn (its chat template with the user's content cut
off) continues with a user request: the kind of request its own instruction tuning showed it. Sampled many
times, that is a prompt source with no end and no download, shaped like what users ask the model: new
kinds of prompt once the offline sources are asked (docs/training.md §Data; the run that used it:
docs/reports/training-scale.md §Stage 5: prompts the target writes itself (shipped)).

A domain is steered by a *starter*, the first words of the user turn ("Write a Python function",
"How many"); the target writes the rest. Chat also samples from the bare prefix. A sample is kept when the
target ended the turn itself (its end-of-turn token, not the length cap), the text reads as a request
(length, words, printable characters), and the prompt filter of `dspark data prompts` accepts it (no
duplicate, no match with or large overlap with an evaluation set, not in an `--exclude` file, not of the
reserved split). Samples are drawn in waves and judged in draw order, each seeded by (seed, draw), so a seed
reproduces the file whatever the engine's batching.

Output: the records of `dspark data prompts` (`{"id", "domain", "source": "self_prompts", "conversations"}`).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.data.decontaminate import EvalIndex, PromptFilter
from dspark.data.eval_sets import find_eval_dir
from dspark.data.prompts import (PromptSetSummary, domain_counts, first_turns, parse_mix, record_id,
                                 write_jsonl)
from dspark.errors import DSparkError

if TYPE_CHECKING:
    from dspark.target.model import TargetModel

SOURCE = "self_prompts"
DEFAULT_MIX_SPEC = "math=0.35,code=0.25,chat=0.4"
# the first words of a user turn, per domain; "" samples from the bare user prefix
STARTERS: dict[str, tuple[str, ...]] = {
    "math": ("How many", "What is the probability that", "Find all", "Find the", "Solve for", "Compute",
             "Prove that", "Let", "If", "A store", "Calculate", "What is the smallest", "Simplify",
             "In a triangle", "A train"),
    "code": ("Write a Python function", "Write a function that", "Implement", "Given an array of integers",
             "Given a string", "How do I", "Write a program that", "Fix the bug in this code:",
             "Create a class", "What does this code do?", "Write a SQL query", "Explain how",
             "Optimize this", "Write a JavaScript function", "Can you write a script that"),
    "chat": ("", "", "", "", "Write", "Explain", "What are", "Can you help me", "I'm", "Give me", "Compare",
             "How can I", "Describe", "Why do", "Create a plan"),
}
MIN_CHARS, MAX_CHARS, MIN_WORDS = 20, 2000, 4
MIN_PRINTABLE = 0.95  # share of characters that are ASCII-printable or whitespace


@dataclass
class Draw:
    """One sample: its index in the draw order, its domain and starter, and what the target wrote."""

    index: int
    domain: str
    starter: str
    text: str = ""
    finished: bool = False  # the target ended the turn with its end-of-turn token


@dataclass
class SelfPromptStats:
    drawn: int = 0
    rejected: Counter = field(default_factory=Counter)  # by reason: unfinished, short, long, unreadable


def user_prefix(target: "TargetModel") -> str:
    """The chat template rendered up to where the first user turn's content starts (the default system
    message included where the template adds one). Raises DSparkError when the tokenizer has no template."""
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise DSparkError("self-written prompts need a tokenizer with a chat template: the target has none")
    sentinel = "\u2063DSPARK\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    if sentinel not in text:
        raise DSparkError("the chat template does not place the user's content verbatim; cannot cut a user prefix")
    return text[:text.index(sentinel)]


def judge(draw: Draw) -> str | None:
    """Why a sample is not a usable request (None when it is)."""
    text = draw.text
    if not draw.finished:
        return "unfinished"
    if len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS:
        return "short"
    if len(text) > MAX_CHARS:
        return "long"
    printable = sum(ch.isascii() and (ch.isprintable() or ch.isspace()) for ch in text)
    if printable < MIN_PRINTABLE * len(text):
        return "unreadable"
    return None


def plan_draws(counts: dict[str, int], seed: int, start: int, n: int) -> list[Draw]:
    """Draws ``start .. start + n - 1``: domains interleaved in proportion to ``counts``, a starter each,
    all fixed by (seed, index)."""
    total = sum(counts.values())
    domains = [d for d in counts if counts[d] > 0]
    draws = []
    for index in range(start, start + n):
        rng = random.Random(f"{seed}:self:{index}")
        domain = rng.choices(domains, weights=[counts[d] / total for d in domains])[0]
        draws.append(Draw(index, domain, rng.choice(STARTERS[domain])))
    return draws


class TargetWriter:
    """Samples user turns from the target through the continuous-batching engine (no drafter)."""

    def __init__(self, target: "TargetModel", batch_size: int, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int) -> None:
        from dspark.serving.engine import Engine, EngineConfig

        self.target, self.seed = target, seed
        self.sampling = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        self.prefix = user_prefix(target)
        self.engine = Engine(target, config=EngineConfig(max_batch=batch_size, max_queue=8 * batch_size))

    def __enter__(self) -> "TargetWriter":
        self.engine.start()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.stop()

    async def _one(self, draw: Draw) -> Draw:
        from dspark.sampling.processing import SamplingParams

        tok = self.target.tokenizer
        ids = tok.encode(self.prefix + draw.starter, add_special_tokens=False)
        params = SamplingParams(self.sampling["temperature"], 0, self.sampling["top_p"],
                                self.sampling["max_new_tokens"], seed=self.seed * 1_000_003 + draw.index)
        handle = self.engine.submit(ids, params, loop=asyncio.get_running_loop())
        tokens: list[int] = []
        reason = None
        async for event in handle.stream():
            tokens.extend(event.token_ids)
            if event.finished:
                reason = event.finish_reason
        if reason not in ("stop", "length"):
            raise DSparkError(f"the engine ended a request with '{reason}'")
        draw.finished = reason == "stop"
        if draw.finished and tokens:
            tokens = tokens[:-1]  # the end-of-turn token
        written = tok.decode(tokens, skip_special_tokens=True)
        draw.text = (draw.starter + written).strip() if draw.starter else written.strip()
        return draw

    def write(self, draws: list[Draw]) -> list[Draw]:
        async def wave() -> list[Draw]:
            return list(await asyncio.gather(*(self._one(d) for d in draws)))
        return asyncio.run(wave())


def build_self_prompt_set(target: "TargetModel", out_path: str | Path, num_prompts: int,
                          mix: str | dict[str, float] | None = None, seed: int = 0,
                          eval_dir: str | Path | None = None, *, max_eval_overlap: float | None = 0.5,
                          exclude: Iterable[str | Path] | None = None, batch_size: int = 32,
                          max_new_tokens: int = 128, temperature: float = 0.8, top_p: float = 0.95,
                          max_draws: int | None = None, allow_short: bool = False,
                          progress: bool = True) -> tuple[PromptSetSummary, SelfPromptStats]:
    """Write ``num_prompts`` prompts the target writes itself (module docstring), mixed by domain.

    Gives up after ``max_draws`` samples (default 4 per prompt): a DSparkError naming the domains short,
    unless ``allow_short``. Deterministic for a seed, target and evaluation sets."""
    from tqdm.auto import tqdm

    if num_prompts <= 0:
        raise DSparkError("the number of prompts must be positive")
    counts = domain_counts(num_prompts, parse_mix(mix or DEFAULT_MIX_SPEC))
    keep = PromptFilter(EvalIndex.from_dir(find_eval_dir(eval_dir)), keep_reserved=False,
                        max_eval_overlap=max_eval_overlap, max_chars=MAX_CHARS)
    for path in exclude or ():
        keep.exclude(first_turns(Path(path)))
    max_draws = 4 * num_prompts if max_draws is None else max_draws
    stats = SelfPromptStats()
    chosen: dict[str, list[str]] = {d: [] for d in counts}
    wave = 4 * batch_size
    with TargetWriter(target, batch_size, max_new_tokens, temperature, top_p, seed) as writer, \
            tqdm(total=num_prompts, desc="self-written prompts", unit="prompt", disable=not progress) as bar:
        while stats.drawn < max_draws and any(len(chosen[d]) < counts[d] for d in counts):
            need = {d: counts[d] - len(chosen[d]) for d in counts}
            draws = plan_draws(need, seed, stats.drawn, min(wave, max_draws - stats.drawn))
            stats.drawn += len(draws)
            for draw in writer.write(draws):  # judged in draw order: the file does not depend on timing
                reason = judge(draw)
                if reason is not None:
                    stats.rejected[reason] += 1
                elif len(chosen[draw.domain]) < counts[draw.domain] and keep.accept(draw.text, draw.text):
                    chosen[draw.domain].append(draw.text)
                    bar.update(1)
            bar.set_postfix(drawn=stats.drawn)
    short = {d: f"{len(chosen[d])}/{counts[d]}" for d in counts if len(chosen[d]) < counts[d]}
    if short and not allow_short:
        shortfall = ", ".join(f"{d} {s}" for d, s in short.items())
        raise DSparkError(f"{max_draws} samples gave too few usable prompts ({shortfall}); raise --max-draws, "
                          "or --allow-short to write what there is")
    rows = [(d, text) for d in counts for text in chosen[d]]
    random.Random(seed).shuffle(rows)
    out_path = Path(out_path)
    write_jsonl(out_path, ({"id": record_id(SOURCE, text), "domain": d, "source": SOURCE,
                            "conversations": [{"role": "user", "content": text}]} for d, text in rows))
    written = {d: len(chosen[d]) for d in counts if chosen[d]}
    summary = PromptSetSummary(path=out_path, requested=counts, written=written,
                               by_source={SOURCE: len(rows)}, dropped=dict(keep.dropped))
    return summary, stats
