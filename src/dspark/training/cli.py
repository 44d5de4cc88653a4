"""`dspark train` (the `dspark data ...` commands are registered by dspark.data.cli)."""

from __future__ import annotations

import argparse
import json
import os

_TRAIN_EPILOG = """\
examples:
  dspark train --config smollm2-dspark-markov
  dspark train --drafter dflash --config smollm2-dflash --set max_steps=200 --set model.num_anchors=16
  dspark train --config smollm2-draft-lm --set model.num_layers=6   # distilled independent draft LM (HF folder)
  dspark train --config my.json --out runs/x --resume          # continue from runs/x/step_latest
  dspark train --config my.json --out runs/x --overwrite       # delete runs/x's checkpoints and start again
  torchrun --nproc_per_node 2 -m dspark.cli train --config smollm2-dspark-markov   # DDP (gloo on CPU)

--set takes KEY=VALUE (VALUE parsed as JSON when it parses, else a string); model.KEY reaches the
drafter config (DSparkConfig / Eagle3Config / DraftLMConfig). Unknown keys are errors. --print-config shows the result.
`dspark --threads N train ...` (or $DSPARK_THREADS) sets num_threads, over the config's value.
"""


def add_cli(sub: argparse._SubParsersAction) -> None:
    from dspark.cli_options import add_device_option
    from dspark.target.loading import DTYPE_NAMES
    from dspark.drafters.registry import KIND_NAMES
    from dspark.presets import preset_names

    p = sub.add_parser(
        "train", help="train a DSpark, DFlash or Eagle3 drafter (or a distilled draft LM) for a frozen target",
        description="Trains a drafter on tokenized data (target features computed online) or on a feature "
        "cache. Works in one process or under torchrun (DDP). Checkpoints go to OUT/step_N with a step_latest "
        "symlink; TensorBoard logs to OUT/tb. Drafter draft-lm is a layer-pruned copy of the target distilled with "
        "KL(target || draft); its checkpoints are ordinary HF causal-LM folders (tokenizer included). "
        f"Presets: {', '.join(preset_names())}.",
        epilog=_TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, metavar="FILE|PRESET",
                   help="a JSON training config or the name of a bundled preset")
    p.add_argument("--drafter", choices=KIND_NAMES, default=None,
                   help="drafter kind (default: the config's 'drafter'); dflash = DSpark backbone without heads; "
                   "draft-lm = an independent draft LM cut from the target and distilled")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field, e.g. --set lr=3e-4 --set model.block_size=7 (repeatable)")
    p.add_argument("--out", default=None, help="output folder (default: the config's 'out')")
    add_device_option(p, default=None, help="where the target and the drafter train (auto = cuda when a GPU is available); "
                      "sets the config's 'device' (default: the config's)")
    p.add_argument("--save-dtype", choices=DTYPE_NAMES, default=None,
                   help="dtype of each checkpoint's model.safetensors; sets the config's 'save_dtype' (default: the "
                   "config's, bfloat16 unless it says otherwise; float32 keeps full-precision drafter files)")
    p.add_argument("--init-from", metavar="CHECKPOINT", default=None,
                   help="start from this drafter checkpoint's weights (same kind and architecture; its draft "
                   "vocabulary comes with it) with a fresh optimizer and LR schedule: fine-tune a drafter on new "
                   "data, or warm-start from a shorter run; model.num_anchors and the loss weights may differ, and "
                   "model.num_draft_layers may be larger (the new layers start as no-ops); sets the config's "
                   "'init_from'")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from OUT/step_latest (or the newest complete OUT/step_N when step_latest is "
                       "missing or dangling); starts at step 0 when OUT holds no checkpoint")
    start.add_argument("--overwrite", action="store_true",
                       help="a new run into an OUT that holds checkpoints: delete them (step_*, step_latest, tb/, "
                       "metrics.jsonl, train_summary.json) first; without it such a run is refused")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from dspark.training.config import load_config
    from dspark.training.trainer import train

    threads = getattr(args, "threads", None) or int(os.environ.get("DSPARK_THREADS", "0") or 0) or None
    cfg = load_config(args.config, args.overrides, drafter=args.drafter, out=args.out, num_threads=threads,
                      device=args.device, save_dtype=args.save_dtype, init_from=args.init_from)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    last = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"last checkpoint: {last}")
    return 0
