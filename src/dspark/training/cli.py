"""`dspark train`, and `dspark data regenerate` / `dspark data features` (registered by data_cli via
``add_data_commands``)."""

from __future__ import annotations

import argparse
import json
import os

from dspark.target.presets import DEFAULT_TARGET

_TRAIN_EPILOG = """\
examples:
  dspark train --config smollm2-dspark-markov
  dspark train --drafter dflash --config smollm2-dflash --set max_steps=200 --set model.num_anchors=16
  dspark train --config smollm2-draft-lm --set model.num_layers=6   # distilled independent draft LM (HF folder)
  dspark train --config my.json --out runs/x --resume          # continue from runs/x/step_latest
  torchrun --nproc_per_node 2 -m dspark.cli train --config smollm2-dspark-markov   # DDP (gloo on CPU)

--set takes KEY=VALUE (VALUE parsed as JSON when it parses, else a string); model.KEY reaches the
drafter config (DSparkConfig / Eagle3Config / DraftLMConfig). Unknown keys are errors. --print-config shows the result.
"""


def add_cli(sub: argparse._SubParsersAction) -> None:
    from dspark.training.config import DRAFTERS, preset_names

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
    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="drafter kind (default: the config's 'drafter'); dflash = DSpark backbone without heads; "
                   "draft-lm = an independent draft LM cut from the target and distilled")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field, e.g. --set lr=3e-4 --set model.block_size=7 (repeatable)")
    p.add_argument("--out", default=None, help="output folder (default: the config's 'out')")
    p.add_argument("--resume", action="store_true", help="continue from OUT/step_latest if it exists")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from dspark.training.config import load_config
    from dspark.training.trainer import train

    cfg = load_config(args.config, args.overrides, drafter=args.drafter, out=args.out)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    last = train(cfg, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"last checkpoint: {last}")
    return 0


# ---------------------------------------------------------------- dspark data regenerate / features

def add_data_commands(data_sub: argparse._SubParsersAction) -> None:
    """Register ``regenerate`` and ``features`` under the ``dspark data`` group (called by data_cli)."""
    p = data_sub.add_parser(
        "regenerate", help="re-answer training prompts with the target itself (self-distillation data)",
        description="Each user turn is re-answered by the target in order, seeing the regenerated history; "
        "system messages are kept, original assistant turns dropped. Output records keep the input fields "
        "plus the new 'conversations' and \"status\": \"success\"; failures go to OUT_error.jsonl. Rerunning "
        "the same command resumes (ids already in OUT are skipped). Sampling defaults follow DeepSpec.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    p.add_argument("--prompts", required=True, help="JSONL of {'id', 'conversations'} or {'turns'} records")
    p.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations decoded together (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="per assistant turn (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.8, help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=20, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each turn's seed is fixed by (seed, line, turn)")
    p.add_argument("--limit", type=int, default=None, help="only the first N records")
    p.set_defaults(func=_regenerate)

    p = data_sub.add_parser(
        "features", help="cache the target's features for training (DeepSpec target-cache format, bf16)",
        description="Runs the target over tokenized training data once and writes the hidden states of the "
        "drafter's target layers plus the final-normed state (never logits) as a sharded, memory-mapped cache: "
        "manifest.json, samples.idx, shard-NNNNN.bin. Disk use is 6 + 2H(n+1) bytes per token (SmolLM2-135M, "
        "5 layers: 6,918 B). Rerun the same command to resume after an interruption. Train on it with "
        "--set feature_source=cache --set cache_dir=OUT.",
    )
    p.add_argument("--config", default=None, metavar="FILE|PRESET",
                   help="take target, data, max_length and target layer ids from a training config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of --config (repeatable)")
    p.add_argument("--target", default=None, help=f"preset or HF folder (default: the config's, else {DEFAULT_TARGET})")
    p.add_argument("--data", nargs="+", default=None, help="tokenized dataset path(s) (default: the config's)")
    p.add_argument("--out", required=True, help="cache folder (new, or an unfinished build to resume)")
    p.add_argument("--layer-ids", default=None,
                   help="comma-separated target layer ids (default: the config's model.target_layer_ids, else 5 "
                   "layers spread from 1 to L-3)")
    p.add_argument("--max-length", type=int, default=None, help="truncate sequences (default: the config's)")
    p.add_argument("--shard-gb", type=float, default=64.0, help="largest shard file in GiB (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="cache only the first N sequences")
    p.set_defaults(func=_features)


def _regenerate(args: argparse.Namespace) -> int:
    from dspark.target.model import load_target
    from dspark.data.regenerate import error_path, regenerate

    target = load_target(args.target)
    stats = regenerate(target, args.prompts, args.out, args.batch_size, args.max_new_tokens, args.temperature,
                       args.top_p, args.top_k, args.seed, args.limit)
    print(f"{args.out}: {stats.succeeded} regenerated, {stats.skipped} already done, {stats.failed} failed "
          f"({error_path(args.out)}), {stats.new_tokens} new tokens")
    return 0


def _features(args: argparse.Namespace) -> int:
    from dspark.target.model import load_target
    from dspark.training.config import TrainConfigError, load_config
    from dspark.data.features import build_feature_cache, bytes_per_token
    from dspark.training.trainer import load_token_dataset

    cfg = load_config(args.config, args.overrides) if args.config else None
    target = load_target(args.target or (cfg.target if cfg else DEFAULT_TARGET), tokenizer=False)
    data = args.data or (cfg.data if cfg else None)
    if not data:
        raise TrainConfigError("dspark data features: give --data or a --config with 'data'")
    if args.layer_ids:
        layer_ids = [int(x) for x in args.layer_ids.split(",")]
    elif cfg and cfg.model.get("target_layer_ids"):
        layer_ids = list(cfg.model["target_layer_ids"])
    else:
        layer_ids = target.default_layer_ids()
    max_length = args.max_length or (cfg.max_length if cfg else None)
    dataset = load_token_dataset(list(data))
    if args.limit is not None:
        if args.limit < 1:
            raise TrainConfigError("--limit must be >= 1")
        dataset = [dataset[i] for i in range(min(args.limit, len(dataset)))]
    out = build_feature_cache(target, dataset, layer_ids, args.out, max_length=max_length,
                              max_shard_bytes=int(args.shard_gb * 2**30), source_paths=list(data))
    print(f"{out}: {len(dataset)} sequences, target layers {layer_ids}, "
          f"{bytes_per_token(target.hidden_size, len(layer_ids))} bytes/token")
    return 0
