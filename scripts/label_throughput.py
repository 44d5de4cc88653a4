"""Teacher-forced labelling against the target's prefill rate (docs/reports/data-throughput.md §Labelling at the machine's
speed).

The reference is the target's prefill: one forward over a sequence with the logits of every position and the
drafter's target layers captured (what labelling needs at least). Against it: ``build_feature_cache``, the code
behind ``dspark data features`` (the same forward without logits, the log-sum-exp of every position through the
LM head, bf16 conversion and the shard writes). Each of ``--procs`` processes (one thread each: "both cores" is 2)
takes its share of the sequences and times the two alternately, ``--repeats`` times, so machine load falls on
both alike; the rates are summed over the processes.

    .venv/bin/python scripts/label_throughput.py --data runs/scale/tok-label-1k --num 60 --procs 2 --dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path


def _worker(args: tuple) -> dict:
    data_dir, indices, dtype_name, layers, repeats, max_length = args
    import torch

    torch.set_num_threads(1)
    from dspark.data.features import build_feature_cache
    from dspark.data.tokenized import TokenizedDataset
    from dspark.target.loading import torch_dtype
    from dspark.target.model import load_target

    target = load_target("smollm2-135m", dtype=torch_dtype(dtype_name), tokenizer=False, fuse=True)
    data = TokenizedDataset(data_dir)
    items = [{k: v[:max_length] for k, v in data[i].items()} for i in indices]
    tokens = sum(int(x["input_ids"].numel()) for x in items)
    prefill_s, build_s = 0.0, 0.0
    with torch.inference_mode():
        target.forward(items[0]["input_ids"], [items[0]["input_ids"].numel()], None, layers, "all")  # warm up
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.inference_mode():
            for x in items:
                target.forward(x["input_ids"], [x["input_ids"].numel()], None, capture_layers=layers,
                               logits_for="all")
        prefill_s += time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            build_feature_cache(target, items, layers, Path(tmp) / "cache", progress=False)
            build_s += time.perf_counter() - t0
    return {"tokens": tokens * repeats, "prefill_s": prefill_s, "build_s": build_s}


def measure(data_dir: str, num: int, procs: int, dtype_name: str, repeats: int, max_length: int) -> dict:
    layers = [1, 8, 14, 20, 27]
    shares = [(data_dir, list(range(r, num, procs)), dtype_name, layers, repeats, max_length) for r in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_worker, shares)
    prefill = sum(p["tokens"] / p["prefill_s"] for p in parts)
    build = sum(p["tokens"] / p["build_s"] for p in parts)
    return {"dtype": dtype_name, "procs": procs, "tokens": sum(p["tokens"] for p in parts),
            "prefill_tok_s": prefill, "features_tok_s": build, "ratio": build / prefill}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="runs/scale/tok-label-1k", help="a `dspark data tokenize` folder")
    ap.add_argument("--num", type=int, default=60, help="sequences (the first N)")
    ap.add_argument("--procs", type=int, default=2, help="processes, one thread each (default: %(default)s)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=1024)
    args = ap.parse_args(argv)
    rows = [measure(args.data, args.num, args.procs, d, args.repeats, args.max_length) for d in args.dtypes.split(",")]
    print("| target dtype | processes | tokens | prefill tok/s | `data features` tok/s | features / prefill |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['procs']} | {r['tokens']:,} | {r['prefill_tok_s']:.0f} | {r['features_tok_s']:.0f} "
              f"| {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
