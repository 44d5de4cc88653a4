"""The target's pass by the number of rows it verifies at one request: what a drafting step's verify costs over a
plain step's (docs/serving.md §Drafting).

    PYTHONPATH=src python scripts/verify_rows_cost.py                   # 1, 2, 4, 8 rows, 12 rounds
    PYTHONPATH=src python scripts/verify_rows_cost.py --rows 1,2 --rounds 20
    PYTHONPATH=src python scripts/verify_rows_cost.py --rows 1,2,3,4,6 --rounds 30 --padding both

``--padding both`` times every count twice per round, with the prepacked products of fewer than
``PackedLinear``'s ``MIN_ROWS`` rows padded to it (as decoding runs them) and unpadded, alternately, and says
whether both gave the same logits, bit for bit.

SmolLM2-135M in bf16 (fused, prepacked), one thread, after a GSM8K prompt in its KV cache; every round runs each
row count once (rows of one round in turn, so a slow spell slows all alike) with the drafter's five target layers
captured and logits of every row, then rolls the cache back. Prints the median milliseconds (the first two rounds
left out) and each count's ratio to one row. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8", help="comma list of rows per pass (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--padding", choices=["on", "both"], default="on",
                   help="on: products padded as decoding runs them; both: padded and unpadded, alternately")
    args = p.parse_args()
    counts = [int(x) for x in args.rows.split(",")]
    if not counts or min(counts) < 1 or args.rounds < 3:
        p.error("--rows needs counts >= 1 and --rounds at least 3")
    torch.set_num_threads(1)

    from dspark.data.eval_sets import load_eval_dataset
    from dspark.target.model import load_target

    target = load_target("smollm2-135m", dtype=torch.bfloat16, fuse=True, pack=True)
    ids = target.encode_chat(load_eval_dataset("gsm8k", limit=1).samples[0].prompt)
    layers = [1, 8, 14, 20, 27]  # the shipped drafter's target layers
    cache = target.new_cache(len(ids) + max(counts) + 8)
    from dspark.modeling import packed

    modes = {"padded": packed.MIN_ROWS} if args.padding == "on" else {"padded": packed.MIN_ROWS, "unpadded": 1}
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in counts}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    with torch.inference_mode():
        target.forward(torch.tensor(ids), [len(ids)], [cache], logits_for="none")
        length = cache.length
        for _ in range(args.rounds):
            for n in counts:
                rows = torch.tensor((ids * n)[-n:])  # (n,) the last n prompt tokens again, positions after the prompt
                for mode, min_rows in modes.items():
                    packed.MIN_ROWS = min_rows
                    t0 = time.perf_counter()
                    out = target.forward(rows, [n], [cache], layers, logits_for="all")
                    times[mode, n].append(time.perf_counter() - t0)
                    logits[mode, n] = out.logits
                    cache.truncate(length)
    base = statistics.median(times["padded", counts[0]][2:])
    for n in counts:
        ms = statistics.median(times["padded", n][2:]) * 1000
        line = f"{n} rows: {ms:6.2f} ms ({ms / (base * 1000):.2f}x {counts[0]} row{'s' if counts[0] > 1 else ''})"
        if "unpadded" in modes:
            bare = statistics.median(times["unpadded", n][2:]) * 1000
            same = torch.equal(logits["padded", n], logits["unpadded", n])
            line += f"; unpadded {bare:6.2f} ms ({bare / ms:.2f}x padded), same logits: {same}"
        print(line, flush=True)

if __name__ == "__main__":
    main()
