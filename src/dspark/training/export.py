"""`dspark export-vocab`: a full-vocabulary DSpark/DFlash checkpoint restricted to a draft vocabulary.

The result carries its draft vocabulary (``draft_vocab`` in model.safetensors, ``draft_vocab_size`` in
config.json), so decoding needs no ``--draft-vocab`` file; it leaves out the frozen embeddings and LM
head (taken from the target when loaded). See ``dspark.drafters.dspark.vocab.prune_to_draft_vocab``.
"""

from __future__ import annotations

import argparse

from dspark.drafters.options import DTYPE_NAMES


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-vocab", help="restrict a DSpark/DFlash checkpoint to a draft vocabulary (small, no side file)",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="example: dspark data vocab --data data/tok --size 8192 --out vocab.json && "
        "dspark export-vocab --checkpoint runs/x/step_latest --vocab vocab.json --out checkpoints/x-vocab8192",
    )
    p.add_argument("--checkpoint", required=True, help="a full-vocabulary DSpark/DFlash checkpoint folder")
    p.add_argument("--vocab", required=True, metavar="FILE", help="a `dspark data vocab` file")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="(default: %(default)s)")
    p.add_argument("--target", default=None,
                   help="the target (preset or folder): needed only when the checkpoint lacks embed_tokens/lm_head")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dspark.drafters.draft_vocab import load_draft_vocab
    from dspark.drafters.dspark.vocab import prune_to_draft_vocab
    from dspark.drafters.options import torch_dtype
    from dspark.modeling.weights import read_config

    target = None
    if args.target:
        from dspark.target.model import load_target

        target = load_target(args.target, tokenizer=False)
    vocab_size = int(read_config(Path(args.checkpoint))["vocab_size"])
    ids = load_draft_vocab(args.vocab, vocab_size)
    out = prune_to_draft_vocab(args.checkpoint, ids, args.out, torch_dtype(args.dtype), target)
    size = (out / "model.safetensors").stat().st_size / 2**20
    print(f"wrote {out} ({len(ids)}-token draft vocabulary, {args.dtype}, model.safetensors {size:.1f} MiB)")
    return 0
