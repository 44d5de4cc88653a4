"""The Alpaca substitute (`dspark data prompts --alpaca-substitute`): an evaluation set of prompts
drawn from the source items that `dspark.data.decontaminate.is_reserved` keeps away from training."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from dspark.data.decontaminate import EvalIndex, PromptFilter
from dspark.data.eval_sets import find_eval_dir
from dspark.data.prompt_sources import PromptSource, default_sources
from dspark.data.prompts import PromptSetSummary, draw_prompts, write_jsonl

SUBSTITUTE_SOURCE = "alpaca-substitute"


def substitute_alpaca(out_path: str | Path, num_prompts: int = 500, seed: int = 0,
                      eval_dir: str | Path | None = None, *, sources: list[PromptSource] | None = None,
                      domains: tuple[str, ...] = ("chat", "code"), max_eval_overlap: float | None = 0.5,
                      progress: bool = True) -> PromptSetSummary:
    """An instruction-following evaluation set standing in for Alpaca, which is not available offline.

    Drawn only from source items reserved away from training (`is_reserved`), so it is disjoint from
    every `build_prompt_set` output, and filtered against the evaluation folder like training
    prompts. Records are `{"turns": [prompt], "source": "alpaca-substitute/<source>"}`. Writes fewer
    prompts when the reserved pool is smaller than `num_prompts` (see the summary).
    """
    from tqdm.auto import tqdm

    keep = PromptFilter(EvalIndex.from_dir(find_eval_dir(eval_dir)), keep_reserved=True,
                        max_eval_overlap=max_eval_overlap)
    sources = default_sources() if sources is None else sources
    sources = [s for s in sources if s.domain in domains]
    with tqdm(total=num_prompts, desc="substitute", unit="prompt", disable=not progress) as bar:
        chosen = draw_prompts(sources, num_prompts, random.Random(f"{seed}:substitute"), seed, keep, bar)
    out_path = Path(out_path)
    write_jsonl(out_path, ({"turns": [text], "source": f"{SUBSTITUTE_SOURCE}/{s.name}"} for s, text in chosen))
    return PromptSetSummary(
        path=out_path, requested={"substitute": num_prompts}, written={"substitute": len(chosen)},
        by_source=dict(Counter(s.name for s, _ in chosen)), dropped=dict(keep.dropped))
