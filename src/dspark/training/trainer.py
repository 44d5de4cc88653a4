"""Drafter training: one process or many under ``torchrun`` (DDP or FSDP2, ``fsdp.py``; gloo on CPU, nccl on GPU).

The loop, per optimizer step: each rank takes ``grad_accum`` sequences (its
disjoint slice of the global batch), builds a ``TrainSample`` for each (target
features computed online or read from the feature cache), runs the drafter
(its outputs; DSpark samples its anchors with a generator seeded from (seed, step,
the sample's place in the global batch)) and the drafter kind's loss module on them (``DrafterWithLoss``,
the one module DDP wraps or FSDP shards), accumulates gradients, clips, and steps AdamW on fp32
master weights. The
learning rate warms up linearly for int(warmup_ratio * total) steps, then
follows a cosine to 0 (docs/interop.md §Training configs; DeepSpec's ``CosineAnnealingWarmupLR``).

Determinism and resume: the data order is a seeded permutation per epoch and
the anchor generator is a function of (seed, step, place in the global batch), so the
only state a resume needs is what the checkpoint holds: fp32 master weights,
AdamW moments, the scheduler and the step. A run killed after checkpoint N and
resumed from ``step_latest`` computes the same step N+1 loss as an uninterrupted run, and runs with
the same global batch split over different ranks x grad_accum see the same samples and anchors.

Output folder (checkpoints: ``checkpoints.py``)::

    out/step_N/            model.safetensors + config.json (the drafter's own format),
                           train_config.json, training_state.rank{r}.pt
    out/step_latest        symlink to the newest step_N (written atomically, after the folder)
    out/tb/                TensorBoard scalars (loss, lr, grad norm, tokens/s, acc@k, ...)
    out/metrics.jsonl      one line per logged step (the same scalars)
    out/train_summary.json written at the end
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark.target.loading import torch_dtype
from dspark.drafters.registry import kind_entry, model_kind_entry
from dspark.drafters.sample import TrainSample
from dspark.errors import DSparkError
from dspark.training.checkpoints import (
    load_training_state,
    prepare_run_folder,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from dspark.training.config import RUN_LENGTH_FIELDS, TrainConfig, TrainConfigError, build_model_config
from dspark.training.distributed import (
    DistInfo,
    all_mean,
    all_sum,
    barrier,
    init_distributed,
    out_of_time,
    resolve_device,
    set_threads,
)
from dspark.training import fsdp
from dspark.training.samples import build_sample_source, draft_vocab_ids, prepare_feature_cache, to_device


# ---------------------------------------------------------------- schedule and data order

def progress_multiplier(progress: float, warmup_ratio: float) -> float:
    """The same warmup + cosine shape over training progress in [0, 1] (used with a time budget)."""
    if progress < warmup_ratio:
        return max(progress / warmup_ratio, 1e-3)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio))))


def lr_multiplier(step: int, total_steps: int, warmup_steps: int) -> float:
    """LR / peak LR while taking optimizer step ``step`` (0-based).

    Linear warmup (step+1)/warmup for the first ``warmup_steps`` steps, then a
    cosine from 1 at step ``warmup_steps`` to 0 at ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, decay) / decay))


@dataclass(frozen=True)
class DataOrder:
    """Which samples each rank trains on at each optimizer step.

    Epoch e uses a permutation seeded by (seed, e), trimmed to whole global
    batches. Global batch j of an epoch is perm[j*G:(j+1)*G]; rank r takes its
    micro-batch a from position a*W + r, so ranks never share a sample.
    """

    num_samples: int
    world_size: int
    grad_accum: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def permutation(self, epoch: int) -> torch.Tensor:  # (steps_per_epoch * G,) int64
        g = torch.Generator().manual_seed(_derive_seed(self.seed, 0x0D47A, epoch))
        return torch.randperm(self.num_samples, generator=g)[: self.steps_per_epoch * self.global_batch]

    def indices(self, step: int, rank: int) -> list[int]:
        epoch, j = divmod(step, self.steps_per_epoch)
        batch = self.permutation(epoch)[j * self.global_batch : (j + 1) * self.global_batch]
        return [int(batch[a * self.world_size + rank]) for a in range(self.grad_accum)]


def _derive_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0])


def micro_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """The generator the drafter samples anchors with. The trainer passes rank 0 and, as ``micro``, the
    sample's place a * W + r in the global batch (``DataOrder``), so only the global batch matters."""
    return torch.Generator().manual_seed(_derive_seed(seed, step, rank, micro))


# ---------------------------------------------------------------- optimizer with fp32 master weights

class MasterWeights:
    """fp32 copies of the trainable parameters for AdamW; the model may run in bf16."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.shared = all(p.dtype == torch.float32 for p in params)
        self.master = params if self.shared else [
            nn.Parameter(p.detach().float().clone()) for p in params
        ]

    def grads_to_master(self) -> None:
        if self.shared:
            return
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.detach().float()

    def master_to_model(self) -> None:
        if self.shared:
            return
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m.to(p.dtype))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if not self.shared:
            for m in self.master:
                m.grad = None


# ---------------------------------------------------------------- the drafter

class DrafterWithLoss(nn.Module):
    """The drafter and its kind's loss module as one module: the forward DDP wraps (its hooks see the call).

    ``forward(sample, generator)`` runs the model (outputs only), then the loss module on those
    outputs and the sample, and returns (loss, metrics).
    """

    def __init__(self, model: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, sample: TrainSample, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss(self.model, self.model(sample, generator), sample)


def build_drafter(cfg: TrainConfig, target, draft_vocab: list[int] | None = None) -> nn.Module:
    """A fresh drafter for ``target``; its random initialisation is fixed by ``cfg.seed``. ``draft_vocab``
    (DSpark/DFlash/Eagle3): the token ids it drafts (``samples.draft_vocab_ids``)."""
    model_cfg = build_model_config(cfg, target.default_layer_ids())
    torch.manual_seed(cfg.seed)
    model_class = kind_entry(cfg.drafter).model_class
    if draft_vocab is not None:
        return model_class.from_target(target, model_cfg, draft_vocab=draft_vocab)
    return model_class.from_target(target, model_cfg)


# model-config fields that say how a drafter is trained, not what it computes: a warm start may change them
TRAINING_ONLY_FIELDS = frozenset({"num_anchors", "loss_decay_gamma", "ce_loss_alpha", "l1_loss_alpha",
                                  "confidence_head_alpha", "step_loss_decay"})


def init_drafter(cfg: TrainConfig, target) -> nn.Module:
    """The drafter of checkpoint ``cfg.init_from`` for ``target``, in float32, to train further.

    It must be of ``cfg.drafter``'s kind, and ``cfg.model`` may only repeat its architecture (its config.json
    decides), change how it is trained (``TRAINING_ONLY_FIELDS``: more anchors, other loss weights) or ask for more
    draft layers than it has (``DSparkModel.grow``); its draft vocabulary comes with it. The optimizer and LR schedule
    start fresh.
    """
    from dspark.drafters.registry import checkpoint_kind

    path = Path(cfg.init_from)
    if not (path / "config.json").is_file():
        raise TrainConfigError(f"init_from {path}: not a drafter checkpoint folder (no config.json)")
    entry = kind_entry(cfg.drafter)
    found = checkpoint_kind(path)
    if kind_entry(found).model_class is not entry.model_class:
        raise TrainConfigError(f"init_from {path}: a {found} checkpoint, but this run trains {cfg.drafter}")
    model = entry.model_class.from_checkpoint(path, target)
    wanted = dict(cfg.model)
    if cfg.drafter == "dflash":  # a DFlash run must not start from a DSpark checkpoint's heads
        wanted.update(markov_rank=0, enable_confidence_head=False)
    settings = {k: wanted.pop(k) for k in TRAINING_ONLY_FIELDS & wanted.keys()}
    changed = {k: v for k, v in settings.items() if getattr(model.config, k, v) != v}
    if changed:  # how this run trains, not what the checkpoint is: the run's values replace the checkpoint's
        print("[dspark] init_from: training with " + ", ".join(
            f"{k}={v!r} (checkpoint: {getattr(model.config, k)!r})" for k, v in sorted(changed.items())), flush=True)
        model.config = dataclasses.replace(model.config, **changed)
    deeper = wanted.get("num_draft_layers")
    if deeper is not None and hasattr(model, "grow") and deeper > model.config.num_draft_layers:
        print(f"[dspark] init_from: {model.config.num_draft_layers} draft layers grown to {deeper} (the new ones start "
              "as copies of the last with zeroed output projections: the drafter's outputs are unchanged)", flush=True)
        model.grow(int(deeper))
    differ = {k: (getattr(model.config, k, None), v) for k, v in wanted.items() if getattr(model.config, k, None) != v}
    if differ:
        shown = ", ".join(f"{k}={have!r} (config: {want!r})" for k, (have, want) in sorted(differ.items()))
        raise TrainConfigError(f"init_from {path}: its architecture differs from the training config: {shown}")
    if cfg.draft_vocab_size is not None or cfg.draft_vocab_file:
        vocab = getattr(model, "draft_vocab", None)
        print(f"[dspark] init_from: the checkpoint's draft vocabulary "
              f"({'all tokens' if vocab is None else f'{vocab.numel()} tokens'}) replaces draft_vocab_size/file",
              flush=True)
    return model.float()


def with_loss(model: nn.Module) -> DrafterWithLoss:
    """``model`` joined with its kind's loss module, configured by the model's own config."""
    return DrafterWithLoss(model, model_kind_entry(model).loss_class(model.config))


# ---------------------------------------------------------------- logging

def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf (dropped) for a blank line or one a killed run left half written."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, TypeError, KeyError):
        return math.inf


def recent_mean(run: Path | str, key: str, lines: int = 100) -> float | None:
    """The mean of ``key`` over the last ``lines`` logged steps of ``run/metrics.jsonl`` (None without any): the
    trainer's estimate over its last few hundred batches, not one batch of 4 sequences like ``final_metrics``."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        return None
    values = []
    for line in path.read_text().splitlines():
        try:
            value = json.loads(line).get(key)
        except (ValueError, AttributeError):  # a half-written last line, or not an object
            continue
        if isinstance(value, (int, float)):
            values.append(float(value))
    tail = values[-lines:]
    return sum(tail) / len(tail) if tail else None


class _Logger:
    """Rank 0 only: tqdm bar, TensorBoard, metrics.jsonl."""

    def __init__(self, out: Path, d: DistInfo, total_steps: int, start_step: int) -> None:
        self.on = d.is_main
        self.bar = self.tb = None
        if not self.on:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=start_step if start_step else None)
        except ImportError:  # tensorboard not installed: metrics.jsonl still has everything
            print("[dspark] no TensorBoard logs: tensorboard is not installed (pip install 'dspark[tensorboard]'); "
                  f"metrics go to {out / 'metrics.jsonl'}", flush=True)
            self.tb = None
        self.jsonl = out / "metrics.jsonl"
        if self.jsonl.exists():  # drop lines from after the checkpoint we resume from
            keep = [ln for ln in self.jsonl.read_text().split("\n") if ln.strip() and _logged_step(ln) <= start_step]
            self.jsonl.write_text("".join(ln + "\n" for ln in keep))

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, step: int, scalars: dict[str, float], group: str = "train") -> None:
        """One metrics.jsonl line; TensorBoard tags ``group/key`` (the held-out scalars are logged as ``val_*``
        keys, under ``val/*`` in TensorBoard)."""
        if not self.on:
            return
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(f"{group}/{k.removeprefix(group + '_')}", v, step)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **{k: round(v, 6) for k, v in scalars.items()}}) + "\n")
        shown = {k: f"{scalars[k]:.4g}" for k in ("loss", "lr", "tokens_per_s") if k in scalars}
        if shown:
            self.bar.set_postfix(shown)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------- the loop

class Trainer:
    """One training run: built from a config, then ``run()`` until max steps or the time budget."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, *, overwrite: bool = False, target=None,
                 model: nn.Module | None = None, dataset=None) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.owns_group = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (
            torch.distributed.is_available() and torch.distributed.is_initialized())
        self.d = d = init_distributed(self.device)
        set_threads(cfg, d, self.device)
        self.dtype = torch_dtype(cfg.dtype)

        self.resume_from = prepare_run_folder(self.out, d, resume, overwrite)  # refuses to overwrite unless told

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        if target is None:
            from dspark.target.model import load_target

            target = load_target(cfg.target, dtype=self.dtype, tokenizer=False)
        target.model.to(self.device)
        if model is None and cfg.init_from:
            model = init_drafter(cfg, target)
        self.model = model if model is not None else build_drafter(cfg, target, draft_vocab_ids(cfg, target))
        self.fsdp = d.distributed and cfg.parallel == "fsdp"  # FSDP keeps fp32 shards, computes in self.dtype
        self.model.to(device=self.device, dtype=torch.float32 if self.fsdp else self.dtype)
        self.model.train()
        layer_ids = list(self.model.target_layer_ids)
        cache_dir = None  # feature_source "auto": the cache built (or found) now; None = online
        if cfg.feature_source == "auto" and dataset is None:
            cache_dir = prepare_feature_cache(cfg, target, layer_ids, d.is_main)
            barrier(d)
        self.source = build_sample_source(cfg, target, layer_ids, self.dtype, dataset, cache_dir=cache_dir,
                                          logsumexp=getattr(self.model, "draft_vocab", None) is not None)

        self.val_source = None  # held-out sequences (cfg.val_cache_dir), never trained on
        if cfg.val_cache_dir:
            val_cfg = dataclasses.replace(cfg, cache_dir=cfg.val_cache_dir, feature_source="cache",
                                          max_samples=cfg.val_samples)
            self.val_source = build_sample_source(val_cfg, target, layer_ids, self.dtype,
                                                  logsumexp=getattr(self.model, "draft_vocab", None) is not None)

        self.accum = cfg.grad_accum_for(d.world_size)
        self.order = DataOrder(len(self.source), d.world_size, self.accum, cfg.seed)
        if self.order.steps_per_epoch < 1:
            raise TrainConfigError(
                f"{len(self.source)} training sequences do not fill one global batch of {self.order.global_batch} "
                f"({d.world_size} processes x grad_accum {self.accum}); add data or lower grad_accum"
            )
        self.total_steps = cfg.max_steps or cfg.epochs * self.order.steps_per_epoch
        self.warmup_steps = int(cfg.warmup_ratio * self.total_steps)

        self.net: nn.Module = with_loss(self.model)
        if self.fsdp:
            online = cache_dir is None and cfg.feature_source != "cache"
            fsdp.shard_target(target, self.device, d.world_size, online=online)
            fsdp.shard_drafter(self.net, self.device, d.world_size, self.dtype)
        self.masters = MasterWeights(list(self.model.trainable_parameters()))
        self.optimizer = torch.optim.AdamW(self.masters.master, lr=cfg.lr, weight_decay=cfg.weight_decay)
        total, warmup = self.total_steps, self.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_multiplier(s, total, warmup))
        self.step, self.tokens_seen, self.prior_seconds = 0, 0.0, 0.0
        if self.resume_from is not None:
            self._restore(self.resume_from)

        if d.distributed and not self.fsdp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.net, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                           find_unused_parameters=cfg.find_unused_parameters)

    # -- state

    def _restore(self, folder: Path) -> None:
        saved_path = folder / "train_config.json"
        if saved_path.is_file():
            saved = {k: v for k, v in json.loads(saved_path.read_text()).items() if not k.startswith("_")}
            diff = self.cfg.resume_mismatch(saved)
            if diff:
                shown = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
                raise TrainConfigError(
                    f"--resume: {saved_path} was trained with other settings ({shown}); resume with the same "
                    "config, or start a new stage from its weights with --init-from into a new --out"
                )
            longer = {k: (saved[k], getattr(self.cfg, k)) for k in RUN_LENGTH_FIELDS
                      if k in saved and saved[k] != getattr(self.cfg, k)}
            if longer and self.d.is_main:
                shown = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in longer.items())
                print(f"[dspark] --resume with another run length ({shown}): the LR schedule follows the new "
                      "length from here", flush=True)
        state = load_training_state(folder, self.d.rank, self.masters.master)
        with torch.no_grad():
            for m, saved in zip(self.masters.master, state["master_weights"], strict=True):
                m.copy_(fsdp.local_slice(saved, m))  # this rank's slice under FSDP, the whole tensor else
        self.masters.master_to_model()
        self.optimizer.load_state_dict(fsdp.shard_optimizer_state(state["optimizer"], self.masters.master))
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step, self.tokens_seen, self.prior_seconds = state["step"], state["tokens_seen"], state["train_seconds"]
        if self.d.is_main:
            print(f"[dspark] resuming from {folder} (step {self.step})", flush=True)

    def _save(self, seconds: float) -> Path:
        state = {
            "step": self.step, "master_weights": fsdp.full_master_weights(self.masters.master),
            "optimizer": fsdp.full_optimizer_state(self.optimizer), "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(), "tokens_seen": self.tokens_seen, "train_seconds": seconds,
            "world_size": self.d.world_size,
            "data_order": {"seed": self.cfg.seed, "next_step": self.step, "grad_accum": self.accum},
        }
        extra = {"world_size": self.d.world_size, "grad_accum_resolved": self.accum,
                 "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                 "num_samples": len(self.source)}
        with fsdp.full_state_dict(self.model) if self.fsdp else nullcontext():  # FSDP: gathered on every rank
            return write_checkpoint(self.out, self.step, self.model, self.cfg, state, self.d, extra)

    # -- one optimizer step

    def _time_progress(self, seconds: float) -> float | None:
        """With a time budget the schedule runs over max(steps, seconds) progress, so a run cut by its
        budget still warms up and decays to zero instead of stopping early in the warmup."""
        if self.cfg.time_budget_s is None:
            return None
        progress = torch.tensor([max(self.step / self.total_steps, seconds / max(self.cfg.time_budget_s, 1e-9))],
                                device=self.device)  # nccl broadcasts GPU tensors only
        if self.d.distributed:  # rank 0's clock decides
            torch.distributed.broadcast(progress, src=0)
        return float(progress)

    def train_step(self, progress: float | None = None) -> tuple[float, dict[str, float], float, int]:
        """Run step ``self.step``; returns (mean loss, mean metrics, grad norm, tokens) of this rank."""
        d, accum = self.d, self.accum
        loss_sum, metric_sums, tokens = 0.0, {}, 0
        self.masters.zero_grad()
        for a, index in enumerate(self.order.indices(self.step, d.rank)):
            sample = to_device(self.source[index], self.device, self.dtype)
            ddp_accumulating = d.distributed and not self.fsdp and a < accum - 1
            with self.net.no_sync() if ddp_accumulating else nullcontext():
                # keyed by the sample's place in the global batch: any (ranks x grad_accum) split draws alike
                generator = micro_generator(self.cfg.seed, self.step, 0, a * d.world_size + d.rank)
                loss, metrics = self.net(sample, generator)
                (loss / accum).backward()
            loss_sum += float(loss.detach())
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
            tokens += int(sample.input_ids.numel())
        self.masters.grads_to_master()
        grad_norm = fsdp.grad_norm_value(torch.nn.utils.clip_grad_norm_(self.masters.master, self.cfg.max_grad_norm))
        if progress is not None:  # time-budget schedule; the step-count scheduler stays idle
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr * progress_multiplier(progress, self.cfg.warmup_ratio)
            self.optimizer.step()
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.masters.master_to_model()
        self.step += 1
        return loss_sum / accum, {k: v / accum for k, v in metric_sums.items()}, grad_norm, tokens

    # -- held-out validation

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean loss and metrics of the held-out sequences, ``val_``-prefixed ({} without ``val_cache_dir``).

        Every rank takes every world_size-th sequence; each sequence's anchors come from a generator seeded by the
        run's seed and the sequence's index, so every validation of a run sees the same blocks and its values are
        comparable from step to step. Ranks run equally many forwards (a short rank repeats its last sequence and
        drops the result), as FSDP's collectives need."""
        if self.val_source is None:
            return {}
        d, n = self.d, len(self.val_source)
        net = self.net.module if hasattr(self.net, "module") else self.net  # no DDP hooks outside training
        per_rank = -(-n // d.world_size)
        sums: dict[str, list[float]] = {}  # key -> [sum, sequences that reported it] (acc@k needs a k-th draft)
        for k in range(per_rank):
            index = d.rank + k * d.world_size
            sample = to_device(self.val_source[min(index, n - 1)], self.device, self.dtype)
            loss, metrics = net(sample, torch.Generator().manual_seed(_derive_seed(self.cfg.seed, 7919, index)))
            if index >= n:
                continue
            for key, v in {**metrics, "loss": loss}.items():
                total = sums.setdefault(key, [0.0, 0])
                total[0] += float(v)
                total[1] += 1
        if d.distributed:  # ranks may hold other keys: merge the dictionaries
            gathered: list[dict[str, list[float]] | None] = [None] * d.world_size
            torch.distributed.all_gather_object(gathered, sums)
            sums = {}
            for part in gathered:
                for key, (v, c) in (part or {}).items():
                    total = sums.setdefault(key, [0.0, 0])
                    total[0] += v
                    total[1] += c
        return {f"val_{key}": v / c for key, (v, c) in sorted(sums.items()) if c}

    # -- the loop

    def run(self) -> Path:
        cfg, d = self.cfg, self.d
        log = _Logger(self.out, d, self.total_steps, self.step)
        start = time.perf_counter()
        session_tokens = 0.0
        last_ckpt, last_scalars, stopped_by = self.resume_from, {}, "max_steps"
        val_every = cfg.val_every or cfg.checkpoint_every
        last_val: dict[str, float] = {}
        try:
            if self.val_source is not None and self.step == 0:  # where the run starts (the init_from checkpoint's)
                last_val = self.validate()
                log.log(0, last_val, group="val")
            while self.step < self.total_steps:
                progress = self._time_progress(self.prior_seconds + time.perf_counter() - start)
                lr = self.optimizer.param_groups[0]["lr"]
                loss, metrics, grad_norm, tokens = self.train_step(progress)
                if progress is not None:  # the step set its own rate from the time progress
                    lr = self.optimizer.param_groups[0]["lr"]
                step_tokens = all_sum(d, tokens)
                self.tokens_seen += step_tokens
                session_tokens += step_tokens
                log.step()
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    keys = sorted(k for k in metrics if k != "loss")
                    vals = all_mean(d, [loss] + [metrics[k] for k in keys])
                    elapsed = time.perf_counter() - start
                    last_scalars = {"loss": vals[0], **dict(zip(keys, vals[1:])), "lr": lr, "grad_norm": grad_norm,
                                    "tokens_per_s": session_tokens / max(elapsed, 1e-9),
                                    "tokens_seen": self.tokens_seen}
                    log.log(self.step, last_scalars)
                if self.val_source is not None and (self.step % val_every == 0 or self.step == self.total_steps):
                    last_val = self.validate()
                    log.log(self.step, last_val, group="val")
                seconds = self.prior_seconds + time.perf_counter() - start
                timed_out = out_of_time(cfg, d, seconds, time.perf_counter() - start)
                if self.step % cfg.checkpoint_every == 0 or self.step == self.total_steps or timed_out:
                    last_ckpt = self._save(seconds)
                if timed_out:
                    stopped_by = "time_budget" if cfg.time_budget_s is not None and seconds >= cfg.time_budget_s \
                        else "session_time"
                    break
            if last_ckpt is None:  # already at total_steps with no checkpoint to show for it
                last_ckpt = self._save(self.prior_seconds)
        finally:
            log.close()
        wall = time.perf_counter() - start
        if d.is_main:
            summary = {
                "steps": self.step, "total_steps": self.total_steps, "stopped_by": stopped_by,
                "tokens_seen": self.tokens_seen, "wall_time_s": round(wall, 3),
                "train_seconds_total": round(self.prior_seconds + wall, 3),
                "tokens_per_s": round(session_tokens / max(wall, 1e-9), 2), "world_size": d.world_size,
                "global_batch": self.order.global_batch, "final_metrics": last_scalars,
                **({"val_metrics": last_val} if last_val else {}),
                "last_checkpoint": str(last_ckpt),
            }
            (self.out / "train_summary.json").write_text(json.dumps(summary, indent=2))
        barrier(d)
        return last_ckpt

    def close(self) -> None:
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train(cfg: TrainConfig, resume: bool = False, *, overwrite: bool = False, target=None,
          model: nn.Module | None = None, dataset=None) -> Path:
    """Train a drafter as ``cfg`` says and return the folder of the last checkpoint.

    ``target``, ``model`` and ``dataset`` may be passed in (tests, notebooks);
    otherwise they are built from ``cfg`` (target folder/preset, drafter class,
    data path or feature cache). ``resume`` continues from ``out/step_latest`` (or, when that is missing or
    dangling, the newest complete step_N); ``overwrite`` lets a new run delete the checkpoints in ``out``.
    """
    trainer = Trainer(cfg, resume, overwrite=overwrite, target=target, model=model, dataset=dataset)
    try:
        return trainer.run()
    finally:
        trainer.close()
