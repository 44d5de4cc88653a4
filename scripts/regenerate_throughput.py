"""Regeneration throughput (docs/reports/data-throughput.md): static batches against the continuous-batching engine.

    .venv/bin/python scripts/regenerate_throughput.py --threads 1 --num 48 --max-new-tokens 128 \
        --static-batch 8 --batch-sizes 8,16,32

Builds --num training prompts from the offline sources (`dspark data prompts`, seed 0), regenerates
them with each path on the same target and seed, and writes records/s, new tokens/s and how many
records equal the static path's to --doc (the static path is today's `dspark data regenerate
--static-batches`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark.data.prompt_sources import default_sources
from dspark.data.prompts import build_prompt_set
from dspark.data.regenerate import regenerate
from dspark.tables import markdown_table
from dspark.target.model import load_target


def _records(path: Path) -> dict[str, dict]:
    return {str(r["id"]): r for r in map(json.loads, path.read_text().splitlines())}


BEGIN, END = "<!-- regenerate-throughput:begin -->", "<!-- regenerate-throughput:end -->"


def write_block(doc: Path, block: str, command: str) -> None:
    """The measured block between the page's markers (the page's own text stays), or a new page."""
    if doc.is_file() and BEGIN in (text := doc.read_text()) and END in text:
        head, rest = text.split(BEGIN, 1)
        doc.write_text(head + BEGIN + "\n" + block + "\n" + END + rest.split(END, 1)[1])
    else:
        doc.write_text("# Regeneration throughput\n\n" + command + "\n\n" + BEGIN + "\n" + block + "\n" + END + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num", type=int, default=48, help="prompts (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--static-batch", type=int, default=8, help="today's --batch-size (default: %(default)s)")
    p.add_argument("--batch-sizes", default="8,16,32", help="engine batches to measure (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-dtypes", default="float32",
                   help="dtypes of the engine rows, comma-separated (bfloat16: batch-invariant, prepacked; "
                   "default: %(default)s)")
    p.add_argument("--unpacked-baseline", action="store_true",
                   help="the static row with plain nn.Linear weights (the decoding layout before prepacking)")
    p.add_argument("--doc", type=Path, default=Path("docs/reports/data-throughput.md"))
    args = p.parse_args(argv)
    bad = [d for d in args.engine_dtypes.split(",") if d not in ("float32", "bfloat16")]
    if bad:
        p.error(f"--engine-dtypes: {', '.join(bad)} is not float32 or bfloat16")
    torch.set_num_threads(args.threads)
    targets: dict[tuple[str, bool], object] = {}

    def target_for(dtype: str, pack: bool):  # as `dspark data regenerate` loads it (float32 on a CPU by default)
        if (dtype, pack) not in targets:
            targets[(dtype, pack)] = load_target(args.target, dtype=getattr(torch, dtype), fuse=True, pack=pack,
                                                 batch_invariant=True)
        return targets[(dtype, pack)]

    rows, command = [], "    .venv/bin/python scripts/regenerate_throughput.py " + " ".join(argv or sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = tmp / "prompts.jsonl"
        summary = build_prompt_set(prompts, args.num, seed=0, sources=default_sources(), progress=False)
        base = "static batches (today" + (", nn.Linear weights)" if args.unpacked_baseline else ")")
        runs = [(base, args.static_batch, True, "float32", not args.unpacked_baseline)]
        runs += [(f"continuous batching (engine{'' if d == 'float32' else ', ' + d})", int(b), False, d, True)
                 for d in args.engine_dtypes.split(",") for b in args.batch_sizes.split(",")]
        reference, base_rate = None, None
        for name, batch, static, dtype, pack in runs:
            out = tmp / f"{'static' if static else 'engine'}-{batch}-{dtype}-{pack}.jsonl"
            t0 = time.perf_counter()
            stats = regenerate(target_for(dtype, pack), prompts, out, batch_size=batch,
                               max_new_tokens=args.max_new_tokens, seed=args.seed, progress=False,
                               static_batches=static)
            seconds = time.perf_counter() - t0
            records = _records(out)
            reference = reference or records
            same = sum(records.get(k) == v for k, v in reference.items())
            rate = stats.new_tokens / seconds
            base_rate = base_rate or rate
            rows.append([name, str(batch), str(stats.succeeded), str(stats.new_tokens), f"{seconds:.1f}",
                         f"{stats.succeeded / seconds:.3f}", f"{rate:.1f}", f"{rate / base_rate:.2f}x",
                         f"{same}/{len(reference)}"])
            print(rows[-1], flush=True)
    table = markdown_table(["path", "batch", "records", "new tokens", "seconds", "records/s", "new tokens/s",
                            "tokens/s vs static", "records equal to static"], rows)
    weights = ("The static row multiplies with plain nn.Linear weights, as the decoding layout did before "
               "prepacking; the engine rows with prepacked ones (src/dspark/modeling/packed.py). "
               if args.unpacked_baseline else "")
    if any(d != "float32" for d in args.engine_dtypes.split(",")):
        weights += ("A bfloat16 row samples from the bf16 target, whose distribution differs slightly from the "
                    "float32 one, so its records differ from the static row's by design. ")
    block = (
        f"`dspark data regenerate` on {args.num} prompts from `dspark data prompts` (domains {summary.written}), "
        f"target {args.target}, {args.threads} thread(s), `--max-new-tokens {args.max_new_tokens}`, "
        f"DeepSpec sampling (temperature 0.7, top_p 0.8, top_k 20), seed {args.seed}, no drafter. "
        "The static path decodes fixed batches and each waits for its longest answer; the engine keeps "
        "`batch` requests decoding and starts the next turn as one ends. Every turn has its own generator "
        "seeded by (seed, line, turn), so the records do not depend on the path. " + weights + "\n\n"
        + "\n".join(table))
    write_block(args.doc, block, command)
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
