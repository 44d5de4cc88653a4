"""bfloat16 attention on the CPU: torch's fused kernel against the block-split path, in one process.

    PYTHONPATH=src python scripts/fused_attention.py --threads 1 [--batches 1,16,32] [--max-new-tokens 64]
        [--repeats 2] [--out docs/reports/performance-fused-attention.md]

Two measurements, each with both paths alternating (``dspark.modeling.attention.FUSED_CPU_ATTENTION``):

1. One attention call (the layer's KV store included) at the shapes a serving step has: decode and verify rows of
   16 and 32 requests with 150-300 cached keys each, one request's verify block, a 256-token prefill piece after 768
   cached keys. SmolLM2-135M's heads (9 query, 3 KV, 64 dims); median milliseconds of ``--calls`` calls.
2. Offline plain decoding: ``SpeculativeGenerator`` with no drafter, SmolLM2-135M in bfloat16 in the decoding
   layout (``load_decoding_target``), greedy, the first prompts of the evaluation mix (chat template, cut to 256
   tokens); generated tokens per second of the whole call (prefill included), best of ``--repeats``, and whether
   both paths emitted the same tokens (both are load-independent, but they round differently, so a greedy
   near-tie may go either way).
3. Which rounding is closer to the model: the prompts and the float32 target's greedy continuations, fed to the
   bf16 target teacher-forced (the prompt whole, then verify blocks of 8 tokens), each path's logits of the
   continuation against the float32 target's (block-split attention: float32 never takes the fused kernel): the
   mean absolute difference, and how often the argmax is the float32 one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.bench.serve_load import load_prompts
from dspark.generation.generator import SpeculativeGenerator
from dspark.modeling import attention as attention_mod
from dspark.modeling.attention import BatchLayout, batched_attention
from dspark.modeling.kv_cache import KVPool
from dspark.sampling.processing import SamplingParams
from dspark.tables import fmt, markdown_table
from dspark.target.loading import load_decoding_target

PATHS = {"block-split": False, "fused": True}
# (label, requests, query rows each, fewest and most cached keys)
SHAPES = [("decode, 16 requests", 16, 1, 150, 300), ("decode, 32 requests", 32, 1, 150, 300),
          ("verify 8 rows, 16 requests", 16, 8, 150, 300), ("verify 8 rows, 1 request", 1, 8, 200, 200),
          ("prefill piece of 256 after 768", 1, 256, 768, 768)]


def _call_ms(requests: int, rows: int, lo: int, hi: int, calls: int) -> dict[str, float]:
    rng = random.Random(0)
    Hq, Hkv, D = 9, 3, 64
    pool = KVPool(1, Hkv, D, slots=requests, capacity=1024 + rows, dtype=torch.bfloat16)
    pool.keys.normal_()
    pool.values.normal_()
    caches = [pool.allocate() for _ in range(requests)]
    for c in caches:
        c.length = rng.randint(lo, hi)
    n = requests * rows
    q, k, v = (torch.randn(n, h, D, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    layout = BatchLayout.build([rows] * requests, caches, torch.device("cpu"))
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(calls + 3):
        for path, fused in PATHS.items():
            attention_mod.FUSED_CPU_ATTENTION = fused
            t0 = time.perf_counter()
            keys, values = layout.store_and_read(0, k, v)
            batched_attention(q, keys, values, layout, D**-0.5)
            if i >= 3:
                times[path].append(time.perf_counter() - t0)
    return {p: 1000 * statistics.median(t) for p, t in times.items()}


def _generate(target, prompts: list[list[int]], max_new: int, fused: bool) -> tuple[float, list[list[int]]]:
    attention_mod.FUSED_CPU_ATTENTION = fused
    gen = SpeculativeGenerator(target)
    t0 = time.perf_counter()
    results = gen.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    wall = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in results) / wall, [r.output_ids for r in results]


def _teacher_forced_logits(target, prompt: list[int], continuation: list[int]) -> torch.Tensor:  # (n, V) float32
    cache = target.new_cache(len(prompt) + len(continuation) + 1)
    out = [target.forward(torch.tensor(prompt), [len(prompt)], [cache], logits_for="last").logits]
    for a in range(0, len(continuation) - 1, 8):
        piece = continuation[a : min(a + 8, len(continuation) - 1)]
        out.append(target.forward(torch.tensor(piece), [len(piece)], [cache]).logits)
    return torch.cat(out).float()  # logits predicting continuation[0], [1], ...


def _error_against_float32(target, prompts: list[list[int]], max_new: int) -> dict[str, tuple[float, float, int]]:
    """{path: (mean |bf16 logit - float32 logit|, share of positions with the float32 argmax, positions)}."""
    reference = load_decoding_target("smollm2-135m", dtype="float32", tokenizer=False)
    sums = {p: [0.0, 0, 0] for p in PATHS}
    for prompt in prompts:
        continuation = SpeculativeGenerator(reference).generate(
            [prompt], SamplingParams(temperature=0.0, max_new_tokens=max_new))[0].output_ids
        want = _teacher_forced_logits(reference, prompt, continuation)  # (n, V)
        for path, fused in PATHS.items():
            attention_mod.FUSED_CPU_ATTENTION = fused
            got = _teacher_forced_logits(target, prompt, continuation)
            sums[path][0] += float((got - want).abs().mean(-1).sum())
            sums[path][1] += int((got.argmax(-1) == want.argmax(-1)).sum())
            sums[path][2] += want.shape[0]
    return {p: (g / n, a / n, n) for p, (g, a, n) in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50, help="attention calls per shape (default: %(default)s)")
    ap.add_argument("--accuracy-prompts", type=int, default=16, help="prompts of the float32 comparison")
    ap.add_argument("--out", default=None, help="write the Markdown page here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    call_rows = []
    for label, requests, rows, lo, hi in SHAPES:
        ms = _call_ms(requests, rows, lo, hi, args.calls)
        print(f"{label}: block-split {ms['block-split']:.3f} ms, fused {ms['fused']:.3f} ms", flush=True)
        call_rows.append([label, fmt(ms["block-split"], 3), fmt(ms["fused"], 3),
                          fmt(ms["block-split"] / ms["fused"], 2) + "x"])
    batches = [int(b) for b in args.batches.split(",")]
    target = load_decoding_target("smollm2-135m", dtype="bfloat16")
    prompts = [target.encode_chat(t)[:256] for t in load_prompts(limit=max(batches))]
    _generate(target, prompts[:2], 4, True)  # warm-up
    gen_rows = []
    for b in batches:
        best = {p: 0.0 for p in PATHS}
        outputs = {}
        for _ in range(args.repeats):
            for path, fused in PATHS.items():
                rate, outputs[path] = _generate(target, prompts[:b], args.max_new_tokens, fused)
                best[path] = max(best[path], rate)
        same = sum(a == b_ for a, b_ in zip(outputs["block-split"], outputs["fused"]))

        print(f"batch {b}: block-split {best['block-split']:.1f} tok/s, fused {best['fused']:.1f}, "
              f"same tokens {same}/{b}", flush=True)
        gen_rows.append([str(b), fmt(best["block-split"], 1), fmt(best["fused"], 1),
                         fmt(best["fused"] / best["block-split"], 2) + "x", f"{same}/{b}"])
    error_rows = []
    for path, (gap, agree, n) in _error_against_float32(target, prompts[: args.accuracy_prompts],
                                                          args.max_new_tokens).items():
        print(f"{path}: mean |logit - float32 logit| {gap:.4f}, argmax equal {agree:.4f} ({n} positions)")
        error_rows.append([path, fmt(gap, 4), fmt(100 * agree, 2) + " %", str(n)])
    attention_mod.FUSED_CPU_ATTENTION = True
    command = "PYTHONPATH=src python scripts/fused_attention.py " + " ".join(sys.argv[1:])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    page = "\n".join([
        "# Fused attention on the CPU (bfloat16)", "",
        f"Written by `{command}` (torch {torch.__version__}, {torch.get_num_threads()} thread(s); load average at "
        f"the end {load}). Both paths ran in this process, alternating; the module docstring of the script says "
        "what each row times.", "",
        "One attention call (KV store included), median milliseconds:", "",
        *markdown_table(["shape", "block-split ms", "fused ms", "speed-up"], call_rows), "",
        f"Offline plain decoding (SmolLM2-135M bf16, greedy, {args.max_new_tokens} new tokens per request, prompts "
        f"cut to 256 tokens, best of {args.repeats}), generated tokens per second, prefill included:", "",
        *markdown_table(["batch", "block-split tok/s", "fused tok/s", "ratio", "same tokens"], gen_rows), "",
        f"Against the float32 target ({args.accuracy_prompts} prompts with its greedy continuations, "
        "teacher-forced: the prompt whole, then blocks of 8 tokens):", "",
        *markdown_table(["bf16 attention", "mean abs logit difference", "argmax as float32", "positions"],
                        error_rows), ""])
    if args.out:
        Path(args.out).write_text(page)
        print(f"wrote {args.out}")
    else:
        print(page)


if __name__ == "__main__":
    main()
