"""Time the fused CPU kernels (dspark.modeling.cpu_kernels) against the torch ops they replace, in one process.

    PYTHONPATH=src python scripts/cpu_kernels.py [--out docs/reports/cpu-kernels.md] [--steps 20]

The default target (SmolLM2-135M) in the decoding layout, bfloat16, one thread: the median wall time of a plain
decode step at batch 1, 4, 16 and 32 (every request CONTEXT tokens into its cache) and of a PROMPT-token prefill,
with ``Decoder.cpu_kernels`` off and on, alternated call by call so that both see the same machine; and the
greedy agreement of the two paths (the share of 64 greedy tokens, 4 prompts, that both emit alike). Writes a
Markdown page with the command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.modeling import cpu_kernels
from dspark.tables import markdown_table
from dspark.target.loading import load_decoding_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="Markdown page to write (default: print only)")
    p.add_argument("--steps", type=int, default=20, help="timed calls per cell and path")
    p.add_argument("--context", type=int, default=250, help="tokens in each request's cache for the decode steps")
    p.add_argument("--prompt", type=int, default=250, help="prefill length")
    p.add_argument("--batches", default="1,4,16,32")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not cpu_kernels.available():
        sys.exit("the fused CPU kernels are not available here (no C compiler, or DSPARK_CPU_KERNELS=0)")
    target = load_decoding_target("smollm2-135m", device="cpu", dtype="bfloat16", tokenizer=False)
    decoder = target.model.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 49000, (max(args.context, args.prompt),), generator=gen)

    def timed(fn, on: bool) -> float:
        decoder.cpu_kernels = on
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    rows = []
    for R in [int(b) for b in args.batches.split(",")]:
        caches = {on: [target.new_cache(args.context + 2 * args.steps + 8) for _ in range(R)] for on in (False, True)}
        for on in (False, True):
            decoder.cpu_kernels = on
            target.forward(ids[: args.context].repeat(R), [args.context] * R, caches[on], logits_for="none")
        step_ids = torch.randint(100, 49000, (R,), generator=gen)
        times = {False: [], True: []}
        for i in range(args.steps + 2):
            for on in (False, True):
                dt = timed(lambda: target.forward(step_ids, [1] * R, caches[on], logits_for="all"), on)
                if i >= 2:
                    times[on].append(dt)
        off, on_ = (1000 * statistics.median(times[k]) for k in (False, True))
        rows.append([f"decode step, batch {R}", f"{off:.1f}", f"{on_:.1f}", f"{off / on_:.2f}x"])
        print(rows[-1], flush=True)
    times = {False: [], True: []}
    for i in range(max(3, args.steps // 4) + 1):
        for on in (False, True):
            dt = timed(lambda: target.forward(ids[: args.prompt], [args.prompt], [target.new_cache(args.prompt + 8)],
                                              logits_for="last"), on)
            if i >= 1:
                times[on].append(dt)
    off, on_ = (1000 * statistics.median(times[k]) for k in (False, True))
    rows.append([f"prefill of {args.prompt} tokens", f"{off:.1f}", f"{on_:.1f}", f"{off / on_:.2f}x"])
    print(rows[-1], flush=True)

    # greedy agreement: the same prompts decoded greedily by both paths
    same = total = 0
    for s in range(4):
        prompt = torch.randint(100, 49000, (32,), generator=torch.Generator().manual_seed(10 + s))
        texts = {}
        for on in (False, True):
            decoder.cpu_kernels = on
            cache = [target.new_cache(128)]
            tok = target.forward(prompt, [32], cache, logits_for="last").logits.argmax(-1)
            out = []
            for _ in range(64):
                out.append(int(tok))
                tok = target.forward(tok, [1], cache, logits_for="all").logits.argmax(-1)
            texts[on] = out
        agree = next((i for i, (a, b) in enumerate(zip(texts[False], texts[True])) if a != b), 64)
        same += agree
        total += 64
    command = "PYTHONPATH=src python scripts/cpu_kernels.py " + " ".join(sys.argv[1:])
    page = "\n".join([
        "# Fused CPU kernels",
        "",
        f"Written by `{command.strip()}` (torch {torch.__version__}, one thread, bfloat16; median of {args.steps} "
        f"calls per cell, the two paths alternated call by call in one process). SmolLM2-135M in the decoding "
        f"layout; decode steps with {args.context} tokens in every request's cache, logits for every row. "
        "`torch ops`: `Decoder.cpu_kernels` off (RMSNorm, RoPE, residual adds, SiLU and the gate product as torch "
        "ops); `kernels`: on (src/dspark/modeling/cpu_kernels.py).",
        "",
        *markdown_table(["call", "torch ops (ms)", "kernels (ms)", "speed-up"], rows),
        "",
        f"Greedy agreement: of 4 x 64 greedy tokens after random 32-token prompts, the two paths emit the same first "
        f"{same} of {total} (a path is one bf16 model; the kernels sum RMSNorm's squares in another order and "
        "compute exp with their own polynomial, so a norm or SiLU output moves by one bf16 step now and then, and "
        "a greedy text can leave the other path's at a near-tie). Each path is load-independent on its own "
        "(tests/modeling/test_cpu_kernels.py, tests/modeling/test_attention.py).",
        "",
    ])
    print(page)
    if args.out:
        Path(args.out).write_text(page)


if __name__ == "__main__":
    main()
