"""Which numbers of rows give a row of a bfloat16 CPU matmul the same bits: the limit of load independence.

A decoding row's bits stay the same under load only if every product it goes through computes it the same way
whatever the other rows of the pass (docs/architecture.md §Making a step cheap). This script multiplies the same
1,200 input rows against each of the target's prepacked linear shapes (q/k/v, gate/up, down, o_proj, LM head),
cut into products of M rows for several M, and counts the output elements that differ from the products of 2
rows (the shape a lone decode row is sent as). Two numbers per cell: elements that differ, and of how many.

    PYTHONPATH=src python scripts/matmul_regimes.py --out docs/reports/matmul-regimes.md

One thread, the CPU's oneDNN kernels through ``PackedLinear`` (``modeling/packed.py``), random inputs of the
hidden size, SmolLM2-135M's shapes by default (``--target`` for another local HF folder's).
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from dspark.modeling.packed import PackedLinear
from dspark.modeling.weights import read_config
from dspark.target.convert import resolve_model_path

ROWS = 1200
SIZES = (1, 2, 8, 16, 32, 33, 48, 64, 128, 256, 512, 1200)


def shapes_of(target: str) -> list[tuple[str, int, int]]:  # (name, out, in)
    cfg = read_config(resolve_model_path(target))
    h, m = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim", h // heads)
    return [("qkv_proj", (heads + 2 * kv) * d, h), ("o_proj", h, heads * d), ("gate_up_proj", 2 * m, h),
            ("down_proj", h, m), ("lm_head", cfg["vocab_size"], h)]


def differing(linear: PackedLinear, x: torch.Tensor, rows: int, base: torch.Tensor) -> int:
    """Elements of the products of ``rows`` rows (the last one padded with zero rows) that differ from ``base``."""
    outs = []
    for start in range(0, x.shape[0], rows):
        piece = x[start : start + rows]
        n = piece.shape[0]
        if n < rows:
            piece = torch.cat([piece, piece.new_zeros(rows - n, piece.shape[1])])
        outs.append(linear(piece)[:n])
    return int((torch.cat(outs) != base).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", type=Path, help="write the Markdown here (default: print it)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the random weights
    gen = torch.Generator().manual_seed(0)
    lines = [f"| shape (out x in) | {' | '.join(f'M={m}' for m in SIZES)} |",
             "|---|" + "---:|" * len(SIZES)]
    for name, out_f, in_f in shapes_of(args.target):
        linear = torch.nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        packed = PackedLinear(linear)
        x = torch.randn(ROWS, in_f, generator=gen).to(torch.bfloat16)  # (ROWS, in)
        base = torch.cat([packed(x[i : i + 2]) for i in range(0, ROWS, 2)])  # every row in a 2-row product
        cells = [str(differing(packed, x, m, base)) for m in SIZES]
        lines.append(f"| {name} ({out_f} x {in_f}) | {' | '.join(cells)} |")
        print(lines[-1], flush=True)
    text = "\n".join([
        "# Which row counts give a bfloat16 matmul row the same bits",
        "",
        f"Written by `PYTHONPATH=src python scripts/matmul_regimes.py --target {args.target}"
        f"{' --out ' + str(args.out) if args.out else ''}` (torch {torch.__version__}, {platform.machine()}, one "
        "thread). Each cell: output elements, of "
        f"{ROWS} rows x out, that differ from the same rows multiplied two at a time, when the rows are multiplied "
        "M at a time (prepacked oneDNN weights, as decoding uses them). 0 = every row has the same bits.",
        "",
        *lines,
        "",
    ])
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        print(text)


if __name__ == "__main__":
    main()
