"""Interpolate the weights of two drafters fine-tuned from the same one (WiSE-FT, Wortsman et al. 2022): every
floating-point tensor becomes (1 - w) * A + w * B, computed in float32 and stored in A's dtype; integer tensors (the
draft vocabulary) must be equal. Used where two warm starts of one drafter each pay on another kind of context
(docs/reports/training-scale.md §Temperature-1 answers to slice R4's prompts).

    python scripts/average_drafters.py checkpoints/smollm2-135m-dspark runs/scale/train/dspark2-t1-R4/step_latest \
        --weight 0.5 --out runs/scale/avg-t1

OUT gets A's config.json and the averaged model.safetensors (and nothing else: calibrate it anew). Two folders whose
configs or tensors differ in anything but the floating-point values are refused with one line naming the difference.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.errors import DSparkError


def average_drafters(a: Path, b: Path, weight: float, out: Path) -> dict[str, int]:
    """Write the interpolated drafter to ``out``; returns {"averaged": n, "kept": m} tensor counts."""
    if not 0.0 <= weight <= 1.0:
        raise DSparkError(f"--weight must lie in [0, 1], got {weight}")
    for folder in (a, b):
        for name in ("config.json", "model.safetensors"):
            if not (folder / name).is_file():
                raise DSparkError(f"{folder}: no {name} (a drafter checkpoint folder holds both)")
    config_a, config_b = (json.loads((f / "config.json").read_text()) for f in (a, b))
    if config_a != config_b:
        keys = sorted(k for k in config_a.keys() | config_b.keys() if config_a.get(k) != config_b.get(k))
        raise DSparkError(f"{a} and {b}: configs differ in {', '.join(keys)}; only twins of one drafter average")
    sa, sb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if sa.keys() != sb.keys():
        raise DSparkError(f"{a} and {b}: tensors differ ({sorted(sa.keys() ^ sb.keys())[:3]} ...)")
    merged, counts = {}, {"averaged": 0, "kept": 0}
    for name, ta in sa.items():
        tb = sb[name]
        if ta.shape != tb.shape:
            raise DSparkError(f"{name}: shape {tuple(ta.shape)} in {a}, {tuple(tb.shape)} in {b}")
        if ta.is_floating_point():
            merged[name] = torch.lerp(ta.float(), tb.float(), weight).to(ta.dtype)
            counts["averaged"] += 1
        else:
            if not torch.equal(ta, tb):
                raise DSparkError(f"{name}: {a} and {b} hold different values (not interpolated: integer tensor)")
            merged[name] = ta
            counts["kept"] += 1
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(a / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "model.safetensors"))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="drafter folder A (its config and dtype are kept)")
    p.add_argument("b", type=Path, help="drafter folder B, fine-tuned from the same drafter as A")
    p.add_argument("--weight", type=float, default=0.5, help="B's share w: (1 - w) * A + w * B (default 0.5)")
    p.add_argument("--out", type=Path, required=True, help="folder to write (config.json, model.safetensors)")
    args = p.parse_args(argv)
    try:
        counts = average_drafters(args.a, args.b, args.weight, args.out)
    except DSparkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {counts['averaged']} tensors interpolated at w = {args.weight:g}, {counts['kept']} integer "
          f"tensors kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
