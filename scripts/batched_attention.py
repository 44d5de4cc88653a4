"""Offline plain decoding with attention batched over the requests against the per-request loop it replaced.

    PYTHONPATH=src python scripts/batched_attention.py --threads 1 [--batches 1,4,16,32] [--max-new-tokens 64]
        [--repeats 2] [--max-prompt-tokens 256] [--out docs/reports/performance-attention.md]

``SpeculativeGenerator`` with no drafter (plain decoding), SmolLM2-135M in bfloat16 in the decoding layout
(fused, prepacked, lone rows run as two), greedy, on the first prompts of the evaluation mix (chat template, cut to
``--max-prompt-tokens``).
For every batch size both attention paths run in the same process, alternating (``Decoder.attention``:
"per-request" = one attention call per request and layer, the path before; "batched" = one call per layer over
the KV pool, ``dspark.modeling.attention``). Reported: generated tokens per second of the whole ``generate``
call (prefill included) and of the decode steps alone, the best of ``--repeats``, their ratio, and whether both
paths emitted the same tokens (they need not: the per-request path attends prefill blocks longer than 16 rows with
SDPA, whose rounding differs, so a greedy near-tie can go the other way).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from dspark.bench.serve_load import load_prompts
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from dspark.tables import fmt, markdown_table
from dspark.target.model import load_target

PATHS = ("per-request", "batched")


def _run(target, prompts: list[list[int]], max_new: int, path: str) -> tuple[float, float, list[list[int]]]:
    """(tok/s of the whole call, tok/s of the decode steps, outputs)."""
    target.model.model.attention = path
    gen = SpeculativeGenerator(target)
    t0 = time.perf_counter()
    results = gen.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in results)
    decode_s = gen.timings.draft_s + gen.timings.verify_s
    decode_tokens = tokens - len(results)  # prefill samples each request's first token
    return tokens / wall, decode_tokens / decode_s, [r.output_ids for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-prompt-tokens", type=int, default=256, help="cut longer prompts (default: %(default)s)")
    ap.add_argument("--out", default=None, help="write the Markdown page here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    target = load_target("smollm2-135m", dtype=torch.bfloat16, fuse=True, batch_invariant=True)
    texts = load_prompts(limit=max(batches))
    prompts = [target.encode_chat(t)[: args.max_prompt_tokens] for t in texts]
    _run(target, prompts[:2], 4, "batched")  # warm-up
    rows = []
    for b in batches:
        best = {p: (0.0, 0.0) for p in PATHS}
        outputs = {}
        for _ in range(args.repeats):
            for path in PATHS:
                total, decode, outs = _run(target, prompts[:b], args.max_new_tokens, path)
                best[path] = (max(best[path][0], total), max(best[path][1], decode))
                outputs[path] = outs
        same = outputs["per-request"] == outputs["batched"]
        print(f"batch {b:>3}: per-request {best['per-request'][0]:7.1f} tok/s (decode {best['per-request'][1]:7.1f}), "
              f"batched {best['batched'][0]:7.1f} (decode {best['batched'][1]:7.1f}), same tokens {same}",
              flush=True)
        rows.append([str(b), fmt(best["per-request"][0], 1), fmt(best["batched"][0], 1),
                     fmt(best["batched"][0] / best["per-request"][0], 2) + "x",
                     fmt(best["per-request"][1], 1), fmt(best["batched"][1], 1),
                     fmt(best["batched"][1] / best["per-request"][1], 2) + "x", "yes" if same else "no"])
    table = markdown_table(["batch", "per-request tok/s", "batched tok/s", "ratio", "decode per-request",
                            "decode batched", "decode ratio", "same tokens"], rows)
    command = "PYTHONPATH=src python scripts/batched_attention.py " + " ".join(sys.argv[1:])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    page = (f"# Batched attention: offline plain decoding\n\nWritten by `{command}`\n"
            f"(torch {torch.__version__}, {torch.get_num_threads()} thread(s), SmolLM2-135M bfloat16, greedy, "
            f"{args.max_new_tokens} new tokens per request, prompts cut to {args.max_prompt_tokens} tokens, best of "
            f"{args.repeats}; load average at the end {load}).\n\n"
            "Generated tokens per second of `SpeculativeGenerator` with no drafter; \"decode\" columns leave the "
            "prefill out. Both paths ran in this process, alternating; \"same tokens\": both emitted identical "
            "output (they need not: the per-request path attends prefill blocks of more than 16 rows with SDPA, "
            "which rounds differently, so a greedy near-tie can go the other way).\n\n" + "\n".join(table) + "\n")
    if args.out:
        Path(args.out).write_text(page)
        print(f"wrote {args.out}")
    else:
        print(page)


if __name__ == "__main__":
    main()
