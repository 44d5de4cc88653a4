"""`dspark export --to sglang|vllm|vocab CHECKPOINT OUT` (and `export-vocab`, its deprecated older form).

``--to sglang`` / ``--to vllm``: the checkpoint rewritten into what that engine loads, plus the launch command
(``dspark.export.engines``); ``--to vocab``: a DSpark/DFlash checkpoint restricted to a draft vocabulary
(``dspark.export.vocab``).
"""

from __future__ import annotations

import argparse
import sys

from dspark.errors import DSparkError
from dspark.export.engines import ENGINES
from dspark.target.loading import DTYPE_NAMES

TARGETS = (*ENGINES, "vocab")


def add_cli(sub: argparse._SubParsersAction) -> None:
    _add_export_vocab(sub)
    _add_export(sub)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a drafter checkpoint as SGLang or vLLM loads it (and print the launch command), "
        "or restricted to a draft vocabulary",
        description="--to sglang|vllm: rewrite a DSpark/DFlash/Eagle3 checkpoint into the files, names and config "
        "fields SGLang's or vLLM's loader reads (bf16), copy the SPS table / STS file beside it, and print the exact "
        "launch command; what the engine cannot load is refused with the reason (docs/serving-at-scale.md). "
        "--to vocab: restrict a full-vocabulary DSpark/DFlash checkpoint to a `dspark data vocab` file; the result "
        "carries its draft vocabulary, so decoding needs no --draft-vocab file.",
        epilog="examples: dspark export --to sglang runs/x/step_latest out/x-sglang --target Qwen/Qwen3-8B "
        "--sps-table sps.json --sts sts.json; dspark data vocab --data data/tok --size 8192 --out vocab.json && "
        "dspark export --to vocab runs/x/step_latest checkpoints/x-vocab8192 --vocab vocab.json",
    )
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="the serving engine, or vocab (a checkpoint restricted to a draft vocabulary)")
    p.add_argument("checkpoint", help="a drafter checkpoint folder (dspark train's step_N/)")
    p.add_argument("out", help="folder to write")
    p.add_argument("--target", default="TARGET", help="the target the engine serves, for the printed command")
    p.add_argument("--target-folder", default=None, metavar="DIR",
                   help="the target's HF folder: vLLM needs its LM-head rows for a draft-vocabulary checkpoint; "
                   "--to vocab reads it (or a preset) only when the checkpoint lacks embed_tokens/lm_head")
    p.add_argument("--sps-table", default=None, metavar="FILE", help="`dspark profile` output (SGLang only)")
    p.add_argument("--sts", default=None, metavar="FILE", help="`dspark calibrate` output (SGLang only)")
    p.add_argument("--vocab", default=None, metavar="FILE", help="--to vocab: a `dspark data vocab` file")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="--to vocab: the dtype written (default: bfloat16; engine exports are always bfloat16)")
    p.set_defaults(func=_run)


def _add_export_vocab(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-vocab", help="deprecated: `dspark export --to vocab CHECKPOINT OUT --vocab FILE` does the same",
        description="Deprecated form of `dspark export --to vocab`: restrict a DSpark/DFlash checkpoint to a draft "
        "vocabulary (small, no side file).",
        epilog="example: dspark export-vocab --checkpoint runs/x/step_latest --vocab vocab.json "
        "--out checkpoints/x-vocab8192",
    )
    p.add_argument("--checkpoint", required=True, help="a full-vocabulary DSpark/DFlash checkpoint folder")
    p.add_argument("--vocab", required=True, metavar="FILE", help="a `dspark data vocab` file")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="(default: %(default)s)")
    p.add_argument("--target", default=None,
                   help="the target (preset or folder): needed only when the checkpoint lacks embed_tokens/lm_head")
    p.set_defaults(func=_run_export_vocab)


def _run(args: argparse.Namespace) -> int:
    if args.to == "vocab":
        for flag, value in (("--sps-table", args.sps_table), ("--sts", args.sts)):
            if value:
                raise DSparkError(f"{flag} is for --to sglang; --to vocab writes no side file")
        if not args.vocab:
            raise DSparkError("--to vocab needs --vocab FILE (a `dspark data vocab` file)")
        return _write_vocab(args.checkpoint, args.vocab, args.out, args.dtype or "bfloat16", args.target_folder)
    for flag, value in (("--vocab", args.vocab), ("--dtype", args.dtype)):
        if value:
            raise DSparkError(f"{flag} is for --to vocab; --to {args.to} writes bfloat16 over the checkpoint's "
                              "own vocabulary")
    from dspark.export.engines import export_for_engine

    plan, command = export_for_engine(args.checkpoint, args.to, args.out, target=args.target,
                                      sps_table=args.sps_table, sts=args.sts, target_folder=args.target_folder)
    for note in plan.notes:
        print(f"note: {note}")
    print(f"wrote {args.out} ({plan.kind}, {len(plan.tensors)} tensors, bf16) for {args.to}; launch with:")
    print(command)
    return 0


def _run_export_vocab(args: argparse.Namespace) -> int:
    print("dspark: `export-vocab` is deprecated: use `dspark export --to vocab CHECKPOINT OUT --vocab FILE`",
          file=sys.stderr)
    return _write_vocab(args.checkpoint, args.vocab, args.out, args.dtype, args.target)


def _write_vocab(checkpoint: str, vocab: str, out: str, dtype: str, target: str | None) -> int:
    from dspark.export.vocab import export_vocab

    folder, size = export_vocab(checkpoint, vocab, out, dtype, target)
    mib = (folder / "model.safetensors").stat().st_size / 2**20
    print(f"wrote {folder} ({size}-token draft vocabulary, {dtype}, model.safetensors {mib:.1f} MiB)")
    return 0
