"""What a new prompt length costs in native memory: the heap in use after target forwards of many distinct
row counts, with ideep's computation cache (LRU_CACHE_CAPACITY) and oneDNN's primitive cache
(ONEDNN_PRIMITIVE_CACHE_CAPACITY) at given capacities.

    PYTHONPATH=src python scripts/native_growth.py --ideep-capacity 1024   # ideep's default
    PYTHONPATH=src python scripts/native_growth.py --ideep-capacity 64     # dspark serve's (serving.memory)
    PYTHONPATH=src python scripts/native_growth.py --ideep-capacity 64 --onednn-capacity 1024  # oneDNN's default

Forwards of N = 1, 4, ..., 238 tokens (80 row counts), the same 80 again, then 80 new ones (2, 5, ...,
239), on SmolLM2-135M in bfloat16 in the decoding layout (prepacked linears), one thread. Prints glibc's
mallinfo2 (heap in use) and VmRSS after each pass, and the seconds of the repeated pass (a cache miss
compiles a kernel again).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ideep-capacity", type=int, required=True)
    p.add_argument("--onednn-capacity", type=int, default=None,
                   help="oneDNN's primitive cache capacity (default: dspark serve's, serving.memory)")
    p.add_argument("--target", default="smollm2-135m")
    args = p.parse_args()
    os.environ["LRU_CACHE_CAPACITY"] = str(args.ideep_capacity)  # before the first matmul reads it
    if args.onednn_capacity is not None:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn_capacity)
    from dspark.serving.memory import cap_onednn_cache, tune_malloc

    cap_onednn_cache()
    tune_malloc()
    import torch

    from dspark.target.loading import load_decoding_target
    from soak_probe import _mallinfo, _status

    torch.set_num_threads(1)
    target = load_decoding_target(args.target, "cpu", "bfloat16", tokenizer=False)

    def forwards(rows: list[int]) -> float:
        t0 = time.perf_counter()
        for n in rows:
            cache = target.new_cache(n + 8)
            target.forward(torch.arange(1000, 1000 + n), [n], [cache], None, logits_for="last")
            cache.release()
        return time.perf_counter() - t0

    def report(what: str, seconds: float | None = None) -> None:
        m = _mallinfo()
        took = f", {seconds:.1f} s" if seconds is not None else ""
        print(f"LRU_CACHE_CAPACITY={args.ideep_capacity:5d} ONEDNN_PRIMITIVE_CACHE_CAPACITY="
              f"{os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY']:>5s} {what:28s} heap in use {m['in_use_mib']:6.0f} MiB, "
              f"VmRSS {_status()['VmRSS'] / 1024:6.0f} MiB{took}", flush=True)

    forwards([5, 5])
    report("after warm-up")
    first = list(range(1, 241, 3))
    forwards(first)
    report("80 row counts")
    report("the same 80 again", forwards(first))
    forwards(list(range(2, 241, 3)))
    report("80 new row counts")


if __name__ == "__main__":
    main()
