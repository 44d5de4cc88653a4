"""`dspark bench train`: drafter-training throughput, the old path against the new one, in one run.

- old: target features computed online in every step, fp32 drafter and target, the full vocabulary
  (``feature_source: online``, ``dtype: float32``, no draft vocabulary);
- new: the feature cache (built once, before the timed steps; its build time is reported apart),
  bf16 drafter and target with fp32 master weights, a draft vocabulary of ``--draft-vocab-size`` tokens.

Both train the same preset on the same sequences in the same order. Each optimizer step is split into
target forward (producing the ``TrainSample``: the target's forward online, a cache read otherwise),
drafter forward, loss, backward and optimizer, timed with ``time.perf_counter`` around each part; the
first ``--warmup`` steps are not counted. The data is a small tokenized set built here from the
docstrings of Python's standard library in the target's chat template (deterministic, no network).
Results go to a Markdown page (``--doc``) that opens with the command that wrote it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from dspark.cli_options import add_device_option
from dspark.target.loading import DTYPE_NAMES, resolve_device
from dspark.target.presets import DEFAULT_TARGET

PARTS = ("target forward", "drafter forward", "loss", "backward", "optimizer")
DEFAULT_DOC = "docs/reports/training-throughput.md"
STDLIB_MODULES = ("json", "pathlib", "argparse", "collections", "itertools", "functools", "re", "csv", "heapq",
                  "bisect", "statistics", "fractions", "decimal", "textwrap", "string", "difflib", "shutil",
                  "tempfile", "glob", "fnmatch", "zipfile", "tarfile", "gzip", "hashlib", "hmac", "secrets",
                  "random", "math", "datetime", "calendar", "enum", "dataclasses", "typing", "abc", "contextlib",
                  "copy", "pprint", "operator", "inspect", "logging", "threading", "queue", "sched", "socket")


def add_cli(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "train", help="drafter-training tokens/s: online fp32 full vocabulary vs cache + bf16 + draft vocabulary",
        description=__doc__.split("\n\n")[0] + " Writes " + DEFAULT_DOC + " (--doc).",
    )
    p.add_argument("--config", default="smollm2-dspark-markov", help="training preset (default: %(default)s)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    p.add_argument("--samples", type=int, default=8, help="training sequences built (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per sequence at most (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per path (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: %(default)s)")
    p.add_argument("--grad-accum", type=int, default=2, help="sequences per step (default: %(default)s)")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="new path (default: %(default)s)")
    p.add_argument("--new-dtype", choices=DTYPE_NAMES, default="bfloat16", help="new path (default: %(default)s)")
    add_device_option(p, help="where both paths train (default: auto = cuda when a GPU is available, else cpu)")
    p.add_argument("--work", default="runs/bench-train", help="scratch folder (default: %(default)s)")
    p.add_argument("--doc", default=DEFAULT_DOC, help="Markdown page to write ('' = none; default: %(default)s)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    result = run_train_bench(args, lambda msg: print(msg, file=sys.stderr, flush=True))
    page = render(result)
    print(page)
    if args.doc:
        Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
        Path(args.doc).write_text(page)
        (Path(args.work) / "result.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {args.doc}", file=sys.stderr)
    return 0


def build_data(tokenizer, folder: Path, samples: int, max_length: int) -> Path:
    """``samples`` chat conversations (user asks about a stdlib module, the assistant answers with its
    documentation), tokenized with the target's chat template and assistant-only loss mask."""
    import importlib
    import inspect

    from dspark.data.tokenized import write_tokenized

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        text = inspect.getdoc(module) or ""
        for obj in list(vars(module).values())[:40]:
            doc = inspect.getdoc(obj) if callable(obj) and getattr(obj, "__module__", None) == name else None
            text += "\n\n" + doc if doc else ""
        if len(text) > 400:
            lines.append({"conversations": [{"role": "user", "content": f"Explain Python's {name} module."},
                                            {"role": "assistant", "content": text}]})
        if len(lines) == samples:
            break
    jsonl = folder / "conversations.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in lines))
    write_tokenized(jsonl, tokenizer, folder / "tok", max_length, progress=False)
    return folder / "tok"


def _time_steps(trainer, steps: int, warmup: int) -> tuple[dict[str, float], int, float]:
    """Run ``warmup + steps`` optimizer steps, the trainer's step split into PARTS; returns seconds per
    part (timed steps only), tokens and seconds in total of the timed steps."""
    import torch

    from dspark.training.samples import to_device
    from dspark.training.trainer import micro_generator

    net = trainer.net
    model, loss_fn = net.model, net.loss
    seconds = dict.fromkeys(PARTS, 0.0)
    tokens = 0
    for step in range(warmup + steps):
        clock: dict[str, float] = dict.fromkeys(PARTS, 0.0)

        def timed(part, fn, *a):
            t = time.perf_counter()
            out = fn(*a)
            if trainer.device.type == "cuda":  # kernels run asynchronously: charge them to their part
                torch.cuda.synchronize(trainer.device)
            clock[part] += time.perf_counter() - t
            return out

        trainer.masters.zero_grad()
        n = 0
        for a, index in enumerate(trainer.order.indices(trainer.step, 0)):
            sample = timed("target forward", lambda i: to_device(trainer.source[i], trainer.device, trainer.dtype),
                           index)
            outputs = timed("drafter forward", model, sample, micro_generator(trainer.cfg.seed, trainer.step, 0, a))
            loss, _ = timed("loss", loss_fn, model, outputs, sample)
            timed("backward", lambda: (loss / trainer.accum).backward())
            n += int(sample.input_ids.numel())

        def optimizer_step():
            trainer.masters.grads_to_master()
            torch.nn.utils.clip_grad_norm_(trainer.masters.master, trainer.cfg.max_grad_norm)
            trainer.optimizer.step()
            trainer.scheduler.step()
            trainer.masters.master_to_model()

        timed("optimizer", optimizer_step)
        trainer.step += 1
        if step >= warmup:
            tokens += n
            for k in PARTS:
                seconds[k] += clock[k]
    return seconds, tokens, sum(seconds.values())


def run_train_bench(args: argparse.Namespace, log) -> dict:
    import torch

    from dspark.data.features import build_feature_cache
    from dspark.data.tokenized import load_tokenized
    from dspark.target.model import load_target
    from dspark.training.config import load_config
    from dspark.training.trainer import Trainer

    device = resolve_device(args.device)  # a bad --device fails before the scratch folder is touched
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    target32 = load_target(args.target, dtype=torch.float32, device=device)
    data = build_data(target32.tokenizer, work / "data", args.samples, args.max_length)
    num_samples = len(load_tokenized([data]))
    total = args.warmup + args.steps
    common = dict(data=[str(data)], max_steps=total, grad_accum=args.grad_accum, max_length=args.max_length,
                  checkpoint_every=10**6, log_every=10**6, num_threads=torch.get_num_threads(), device=device)
    paths: dict[str, dict] = {}

    log("[bench train] old path: online target features, float32, full vocabulary")
    cfg = old_path_config(args.config, out=str(work / "old"), **common)
    trainer = Trainer(cfg, target=target32)
    paths["old"] = _measure(trainer, args, "online, float32, full vocabulary")

    log(f"[bench train] new path: feature cache, {args.new_dtype}, draft vocabulary {args.draft_vocab_size}")
    dtype = getattr(torch, args.new_dtype)
    target_new = target32 if dtype == torch.float32 else load_target(args.target, dtype=dtype, tokenizer=False,
                                                                     device=device)
    layer_ids = cfg.model.get("target_layer_ids") or target32.default_layer_ids()
    t = time.perf_counter()
    cache = build_feature_cache(target_new, load_tokenized([data]), layer_ids, work / "cache",
                                max_length=args.max_length, source_paths=[str(data)], progress=False)
    build_s = time.perf_counter() - t
    cfg = load_config(args.config, [], out=str(work / "new"), feature_source="cache", cache_dir=str(cache),
                      dtype=args.new_dtype, draft_vocab_size=args.draft_vocab_size, **common)
    trainer = Trainer(cfg, target=target_new)
    paths["new"] = _measure(trainer, args, f"feature cache, {args.new_dtype} + fp32 master weights, "
                                           f"draft vocabulary {trainer.model.draft_size}")
    tokens_in_data = int(sum(len(load_tokenized([data])[i]["input_ids"]) for i in range(num_samples)))
    paths["new"]["cache_build_s"] = build_s
    paths["new"]["cache_build_tokens"] = tokens_in_data
    ckpt = work / "new-checkpoint"
    trainer.model.save_checkpoint(ckpt, torch.bfloat16)
    return {
        "command": " ".join(["dspark", *sys.argv[1:]]) if sys.argv and "bench" in sys.argv else "dspark bench train",
        "config": args.config, "target": args.target, "samples": num_samples, "max_length": args.max_length,
        "steps": args.steps, "warmup": args.warmup, "grad_accum": args.grad_accum, "threads": torch.get_num_threads(),
        "device": device,
        "paths": paths, "speedup": paths["new"]["tokens_per_s"] / paths["old"]["tokens_per_s"],
        "checkpoint_mib": (ckpt / "model.safetensors").stat().st_size / 2**20,
    }


def old_path_config(config: str, **fields):
    """The old path's training config: ``config`` with online features, float32 and the full vocabulary (the
    preset's draft vocabulary switched off: ``load_config`` ignores fields set to None, so it takes overrides)."""
    from dspark.training.config import load_config

    return load_config(config, ["draft_vocab_size=null", "draft_vocab_file=null"], feature_source="online",
                       dtype="float32", **fields)


def _measure(trainer, args: argparse.Namespace, label: str) -> dict:
    seconds, tokens, total = _time_steps(trainer, args.steps, args.warmup)
    return {"label": label, "seconds": seconds, "tokens": tokens, "total_s": total,
            "tokens_per_s": tokens / max(total, 1e-9)}


def render(result: dict) -> str:
    from dspark.tables import markdown_table

    old, new = result["paths"]["old"], result["paths"]["new"]
    rows = []
    for part in PARTS:
        o, n = old["seconds"][part], new["seconds"][part]
        steps = result["steps"]
        rows.append([part, f"{1000 * o / steps:.0f}", f"{100 * o / old['total_s']:.0f} %",
                     f"{1000 * n / steps:.0f}", f"{100 * n / new['total_s']:.0f} %",
                     f"{o / n:.1f}x" if n > 0 else "-"])
    rows.append(["**step**", f"{1000 * old['total_s'] / result['steps']:.0f}", "100 %",
                 f"{1000 * new['total_s'] / result['steps']:.0f}", "100 %", f"{old['total_s'] / new['total_s']:.1f}x"])
    table = "\n".join(markdown_table(["part", "old ms/step", "old share", "new ms/step", "new share", "old / new"], rows))
    build_tps = new["cache_build_tokens"] / max(new["cache_build_s"], 1e-9)
    return f"""# Drafter training throughput

Written by `{result['command']}` (`src/dspark/bench/train.py`), on this machine with
{result['threads']} thread(s): preset `{result['config']}`, target `{result['target']}`, {result['samples']}
sequences of at most {result['max_length']} tokens (stdlib docstrings in the chat template),
{result['grad_accum']} sequences per optimizer step, {result['steps']} timed steps after {result['warmup']} untimed.

- **old**: {old['label']}: **{old['tokens_per_s']:.0f} tokens/s**
- **new**: {new['label']}: **{new['tokens_per_s']:.0f} tokens/s**
- **new / old: {result['speedup']:.1f}x** (the goal was 10x)

{table}

Both paths run the same code (RoPE tables once per forward, the loss terms of all rows in one tensor
expression when they fit, the vanilla head's latents as one gather); they differ in the three settings
above. The machine is shared with other jobs, so single timings are noisy; the ratio is what to read.

"target forward" is producing the training sample: the frozen target's forward pass online, a read of
the feature cache in the new path. The cache was built once before the timed steps:
{new['cache_build_s']:.1f} s for {new['cache_build_tokens']} tokens ({build_tps:.0f} tokens/s, one target pass per
sequence, paid once and reused by every later epoch and run). Counting that build, a first epoch on the
new path runs at {new['cache_build_tokens'] / (new['cache_build_s'] + new['cache_build_tokens'] / new['tokens_per_s']):.0f} tokens/s.
The new path's checkpoint (1 draft layer, bf16, draft vocabulary, no frozen embeddings) is
{result['checkpoint_mib']:.1f} MiB.
"""
