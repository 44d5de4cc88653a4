"""Time prepacked CPU matmuls (dspark.modeling.packed) against plain nn.Linear, and check batch invariance.

    python scripts/packed_linears.py [--threads 1] [--out docs/reports/performance-packing.md]

For the default target (SmolLM2-135M) in float32 and bfloat16, in the decoding layout (fused q/k/v and gate/up):
the median wall time of a one-token step and an 8-token verify block after a prompt in the cache, and of the
prompt's prefill, with the weights packed and not, in the same process; and for the shipped reference drafter, the median
time of one 7-token proposal. Decoding runs a lone row as two (``Decoder.batch_invariant``); the column "lone row
as one" times the same 1-token step without that. The last columns give the largest logit
difference between 8 one-token steps and one 8-token block (``TargetModel.step_block_gap``; 0 = bitwise equal,
what exact greedy decoding needs) with lone rows run as two and without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.drafters.base import RequestState
from dspark.drafters.dspark.drafter import load_dspark_drafter
from dspark.sampling.processing import SamplingParams
from dspark.tables import fmt, markdown_table
from dspark.target.model import load_target

REFERENCE = "checkpoints/smollm2-135m-dspark"
PROMPT = "Write a Python function that checks whether a number is prime, then explain how it works. " * 3


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _step_ms(target, ids: list[int], n: int, repeats: int) -> float:
    """Median ms of a forward of ``ids[:n]`` (all logits) after the whole of ``ids`` in the cache."""
    cache = target.new_cache(1024)
    target.forward(torch.tensor(ids), [len(ids)], [cache], logits_for="none")
    layers = target.default_layer_ids()

    def run():
        target.forward(torch.tensor(ids[:n]), [n], [cache], layers, logits_for="all")
        cache.truncate(len(ids))

    return _median_ms(run, repeats)


def _lone_row_ms(target, ids: list[int], repeats: int) -> dict[bool, float]:
    """Median ms of a 1-token step with the lone row run as two (True) and as one (False), interleaved call by
    call so that both see the same machine."""
    cache = target.new_cache(1024)
    target.forward(torch.tensor(ids), [len(ids)], [cache], logits_for="none")
    layers, decoder = target.default_layer_ids(), target.model.model
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats * 3 + 6):
        for twin in (True, False):
            decoder.batch_invariant = twin
            t0 = time.perf_counter()
            target.forward(torch.tensor(ids[:1]), [1], [cache], layers, logits_for="all")
            if i >= 6:  # warm-up calls
                times[twin].append(time.perf_counter() - t0)
            cache.truncate(len(ids))
    return {twin: 1000 * statistics.median(v) for twin, v in times.items()}


def _block_times(target, ids: list[int], repeats: int) -> dict[str, float]:
    return {"8 tokens": _step_ms(target, ids, 8, repeats), "prefill": _step_ms(target, ids, len(ids), max(3, repeats // 4))}


def _draft_ms(target, pack: bool, ids: list[int], repeats: int) -> float:
    drafter = load_dspark_drafter(REFERENCE, target, pack=pack)
    feats = target.forward(torch.tensor(ids[:-1]), [len(ids) - 1], None, drafter.target_layer_ids,
                           logits_for="none").features
    sp = SamplingParams(temperature=0.0, max_new_tokens=64)
    req = RequestState("r", len(ids) - 1, list(ids), sp, sp.make_generator())
    req.context_features = feats
    drafter.propose([req], [7])  # the context projection, once: later calls time the proposal alone
    return _median_ms(lambda: drafter.propose([req], [7]), repeats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per cell (default: %(default)s)")
    p.add_argument("--out", default="docs/reports/performance-packing.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows, drafts = [], []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            times = {}
            for pack in (False, True):
                target = load_target("smollm2-135m", dtype=dtype, fuse=True, pack=pack, batch_invariant=True)
                ids = target.encode_chat(PROMPT)
                decoder = target.model.model
                decoding_flag = decoder.batch_invariant  # what load_target chose (bf16 on the CPU: True)
                decoder.batch_invariant = True
                gap = target.step_block_gap()
                decoder.batch_invariant = False  # lone rows as one row: oneDNN's one-row path
                raw_gap = target.step_block_gap()
                lone = _lone_row_ms(target, ids, args.repeats)
                decoder.batch_invariant = decoding_flag
                times[pack] = {"1 token, as two": lone[True], "1 token, as one": lone[False],
                               **_block_times(target, ids, args.repeats)}
                rows.append([str(dtype).removeprefix("torch."), "packed" if pack else "nn.Linear",
                             *[fmt(v, 1) for v in times[pack].values()], f"{gap:.2g}", f"{raw_gap:.2g}"])
                drafts.append([str(dtype).removeprefix("torch."), "packed" if pack else "nn.Linear",
                               fmt(_draft_ms(target, pack, ids, args.repeats), 2)])
                print(rows[-1], drafts[-1], file=sys.stderr)
            rows.append([rows[-1][0], "ratio", *[f"{fmt(times[False][k] / times[True][k])}x" for k in times[True]],
                         "", ""])
    prompt_len = len(ids)
    lines = [
        "# Prepacked CPU matmuls", "",
        f"Written by `python scripts/packed_linears.py --threads {args.threads}` (median of {args.repeats} calls per "
        f"cell, one process; torch {torch.__version__}, {torch.get_num_threads()} thread(s)). The target "
        f"SmolLM2-135M in the decoding layout (fused q/k/v and gate/up), a prompt of {prompt_len} tokens in the "
        "cache; `ratio` = nn.Linear over packed. See `src/dspark/modeling/packed.py`. A 1-token step 'as two' is "
        "what decoding runs in bf16 on the CPU (`Decoder.batch_invariant`); 'as one' is the same step without it, "
        "timed call by call in alternation with it.", "",
        "## Target forward (ms)", "",
        *markdown_table(["dtype", "weights", "1-token step, as two", "1-token step, as one", "8-token verify",
                         f"{prompt_len}-token prefill", "max logit gap, 8 steps vs 1 block",
                         "the same, lone rows as one"], rows), "",
        "## One 7-token proposal of the reference drafter (ms)", "",
        *markdown_table(["dtype", "drafter weights", "propose"], drafts), "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
