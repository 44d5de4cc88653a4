"""Training prompt sets: draw from the offline sources by domain, decontaminated, as JSONL.

The sources are in `dspark.data.prompt_sources`, the filters in `dspark.data.decontaminate`.
Output record (one JSON object per line):
`{"id", "domain", "source", "conversations": [{"role": "user", "content": ...}]}`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.data.decontaminate import EvalIndex, PromptFilter
from dspark.data.eval_sets import find_eval_dir
from dspark.data.prompt_sources import DATA_EXTRA_HINT, DOMAINS, PromptSource, default_sources
from dspark.errors import DSparkError

DEFAULT_MIX = {"math": 0.4, "code": 0.3, "chat": 0.3}


@dataclass
class PromptSetSummary:
    path: Path
    requested: dict[str, int]
    written: dict[str, int]
    by_source: dict[str, int]
    dropped: dict[str, int]

    def __str__(self) -> str:
        return (f"wrote {sum(self.written.values())} prompts to {self.path}: "
                f"domains {self.written} (requested {self.requested}), sources {self.by_source}, "
                f"dropped {self.dropped}")


def parse_mix(spec: str | dict[str, float] | None) -> dict[str, float]:
    """`"math=0.4,code=0.3,chat=0.3"` (or a dict) -> fractions that sum to 1."""
    if spec is None:
        spec = DEFAULT_MIX
    if isinstance(spec, str):
        try:
            spec = {k.strip(): float(v) for k, v in (part.split("=") for part in spec.split(",") if part.strip())}
        except ValueError as err:
            raise DSparkError(f"bad mix {spec!r}: write it as math=0.4,code=0.3,chat=0.3") from err
    unknown = set(spec) - set(DOMAINS)
    if unknown or any(v < 0 for v in spec.values()) or sum(spec.values()) <= 0:
        raise DSparkError(f"bad mix {spec}: use the domains {DOMAINS} with non-negative weights, not all 0")
    total = sum(spec.values())
    return {d: spec.get(d, 0.0) / total for d in DOMAINS}


def domain_counts(num: int, mix: dict[str, float]) -> dict[str, int]:
    """Largest-remainder rounding, so that the counts sum to `num` exactly."""
    raw = {d: num * f for d, f in mix.items()}
    counts = {d: int(r) for d, r in raw.items()}
    for d in sorted(raw, key=lambda d: (counts[d] - raw[d], DOMAINS.index(d)))[: num - sum(counts.values())]:
        counts[d] += 1
    return counts


def draw_prompts(sources: list[PromptSource], count: int, rng: random.Random, seed: int,
          keep: PromptFilter, progress=None) -> list[tuple[PromptSource, str]]:
    """Up to `count` accepted prompts, drawing from the sources by weight until they run dry."""
    streams = {s.name: iter(s.candidates(random.Random(f"{seed}:{s.name}"))) for s in sources}
    return draw_by_weight(sources, streams, count, rng, keep.accept, progress)


def draw_by_weight(sources: list, streams: dict[str, Iterator], count: int, rng: random.Random,
                   accept: Callable[[str, Any], bool], progress=None) -> list[tuple[Any, Any]]:
    """Up to `count` accepted (source, item) pairs: pick a source by its `weight`, take the next (key, item) of
    its stream (`streams[source.name]`), keep it if `accept(key, item)`; a stream that runs dry drops out."""
    live = list(sources)
    chosen = []
    while len(chosen) < count and live:
        source = rng.choices(live, weights=[s.weight for s in live])[0]
        try:
            key, item = next(streams[source.name])
        except StopIteration:
            live.remove(source)
            continue
        if accept(key, item):
            chosen.append((source, item))
            if progress is not None:
                progress.update(1)
    return chosen


def _shortfall_error(domain: str, got: int, wanted: int, sources: list[PromptSource]) -> DSparkError:
    names = ", ".join(s.name for s in sources) or "none"
    return DSparkError(
        f"only {got} of {wanted} {domain} prompts are available offline (sources: {names}). Lower "
        f"--num, change --mix, add data (python3.11-doc for python_docs, the `evals` wheel via "
        f"DSPARK_EVALS_WHEEL for openai_evals, {DATA_EXTRA_HINT}), or pass --allow-short"
    )


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def record_id(source: str, text: str) -> str:
    return f"{source}-{hashlib.sha1(text.encode('utf-8')).hexdigest()[:12]}"


def first_turns(path: Path) -> Iterator[str]:
    """The first user turn of every record of a prompt file; a missing or damaged file is a one-line error."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    yield json.loads(line)["conversations"][0]["content"]
                except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
                    raise DSparkError(f"{path}, line {number}: not a prompt record of `dspark data prompts` "
                                      f"({type(err).__name__})") from err
    except OSError as err:
        raise DSparkError(f"{path}: cannot read the prompt file to exclude ({err.strerror})") from err


def build_prompt_set(out_path: str | Path, num_prompts: int, mix: str | dict[str, float] | None = None,
                     seed: int = 0, eval_dir: str | Path | None = None, *,
                     sources: list[PromptSource] | None = None, max_eval_overlap: float | None = 0.5,
                     allow_short: bool = False, progress: bool = True,
                     exclude: Iterable[str | Path] | None = None) -> PromptSetSummary:
    """Write `num_prompts` training prompts, mixed by domain, as JSONL (see the module docstring).

    Deterministic for a given seed, source data and Python version. Raises DSparkError when a domain
    cannot be filled, unless `allow_short` (then that domain is written short). The prompts of the files in
    `exclude` (earlier prompt sets) are not drawn again.
    """
    from tqdm.auto import tqdm

    if num_prompts <= 0:
        raise DSparkError("the number of prompts must be positive")
    counts = domain_counts(num_prompts, parse_mix(mix))
    keep = PromptFilter(EvalIndex.from_dir(find_eval_dir(eval_dir)), keep_reserved=False,
                        max_eval_overlap=max_eval_overlap)
    for path in exclude or ():
        keep.exclude(first_turns(Path(path)))
    sources = default_sources() if sources is None else sources
    chosen: list[tuple[PromptSource, str]] = []
    with tqdm(total=num_prompts, desc="prompts", unit="prompt", disable=not progress) as bar:
        for domain in DOMAINS:
            if counts[domain] == 0:
                continue
            domain_sources = [s for s in sources if s.domain == domain]
            rng = random.Random(f"{seed}:{domain}")
            got = draw_prompts(domain_sources, counts[domain], rng, seed, keep, bar)
            if len(got) < counts[domain] and not allow_short:
                raise _shortfall_error(domain, len(got), counts[domain], domain_sources)
            chosen += got
    random.Random(seed).shuffle(chosen)
    out_path = Path(out_path)
    write_jsonl(out_path, ({"id": record_id(s.name, text), "domain": s.domain, "source": s.name,
                             "conversations": [{"role": "user", "content": text}]} for s, text in chosen))
    return PromptSetSummary(
        path=out_path, requested=counts,
        written=dict(Counter(s.domain for s, _ in chosen)),
        by_source=dict(Counter(s.name for s, _ in chosen)), dropped=dict(keep.dropped))

