"""Time prepacked CPU matmuls (dspark.modeling.packed) against plain nn.Linear, and check batch invariance.

    python bench/packed_linears.py [--threads 1] [--out docs/performance-packing.md]

For the default target (SmolLM2-135M) in float32 and bfloat16, in the decoding layout (fused q/k/v and gate/up):
the median wall time of a one-token step and an 8-token verify block after a prompt in the cache, and of the
prompt's prefill, with the weights packed and not, in the same process; and for the shipped reference drafter, the median
time of one 7-token proposal. The last columns say whether 8 one-token steps give bitwise the logits of one
8-token block (``TargetModel.batch_invariance_holds``) with lone rows run as two (``Decoder.batch_invariant``, what
decoding does in bf16 on the CPU; float32 is not made invariant) and without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.drafters.base import RequestState
from dspark.drafters.options import DraftingOptions
from dspark.drafters.registry import load_drafter
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


def _target_times(target, ids: list[int], repeats: int) -> dict[str, float]:
    cache = target.new_cache(1024)
    prefix = len(ids)
    target.forward(torch.tensor(ids), [prefix], [cache], logits_for="none")
    layers = target.default_layer_ids()

    def step(n: int):
        def run():
            target.forward(torch.tensor(ids[:n]), [n], [cache], layers, logits_for="all")
            cache.truncate(prefix)
        return run

    return {"1 token": _median_ms(step(1), repeats), "8 tokens": _median_ms(step(8), repeats),
            f"{prefix} tokens": _median_ms(step(prefix), max(3, repeats // 4))}


def _draft_ms(target, pack: bool, ids: list[int], repeats: int) -> float:
    import dspark.drafters.dspark.drafter as dspark_drafter

    real = dspark_drafter.pack_all_linears
    dspark_drafter.pack_all_linears = real if pack else (lambda module: 0)
    try:
        drafter = load_drafter(REFERENCE, target, DraftingOptions())
    finally:
        dspark_drafter.pack_all_linears = real
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
    p.add_argument("--out", default="docs/performance-packing.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows, drafts = [], []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            times = {}
            for pack in (False, True):
                target = load_target("smollm2-135m", dtype=dtype, fuse=True, pack=pack, batch_invariant=True)
                ids = target.encode_chat(PROMPT)
                times[pack] = _target_times(target, ids, args.repeats)
                invariant = target.batch_invariance_holds()
                target.model.model.batch_invariant = False  # lone rows as one row: the plain GEMV path
                raw = target.batch_invariance_holds()
                target.model.model.batch_invariant = True
                rows.append([str(dtype).removeprefix("torch."), "packed" if pack else "nn.Linear",
                             *[fmt(v, 1) for v in times[pack].values()],
                             "yes" if invariant else "no", "yes" if raw else "no"])
                drafts.append([str(dtype).removeprefix("torch."), "packed" if pack else "nn.Linear",
                               fmt(_draft_ms(target, pack, ids, args.repeats), 2)])
                print(rows[-1], drafts[-1], file=sys.stderr)
            rows.append([rows[-1][0], "ratio", *[f"{fmt(times[False][k] / times[True][k])}x" for k in times[True]],
                         "", ""])
    keys = list(times[True])
    lines = [
        "# Prepacked CPU matmuls", "",
        f"Written by `python bench/packed_linears.py --threads {args.threads}` (median of {args.repeats} calls per "
        f"cell, one process; torch {torch.__version__}, {torch.get_num_threads()} thread(s)). The target "
        "SmolLM2-135M in the decoding layout (fused q/k/v and gate/up), a prompt of "
        f"{keys[2].split()[0]} tokens in the cache; `ratio` = nn.Linear over packed. See "
        "`src/dspark/modeling/packed.py`.", "",
        "## Target forward (ms)", "",
        *markdown_table(["dtype", "weights", "1-token step", "8-token verify", f"{keys[2]} prefill",
                         "8 steps = 1 block, bitwise", "the same, lone rows not run as two"], rows), "",
        "## One 7-token proposal of the reference drafter (ms)", "",
        *markdown_table(["dtype", "drafter weights", "propose"], drafts), "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
