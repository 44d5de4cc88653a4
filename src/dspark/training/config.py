"""Training configuration: one typed dataclass, JSON presets, ``--set key=value`` overrides.

A config file is a JSON object whose keys are ``TrainConfig`` fields. Keys that
start with ``_`` are comments (every preset opens with ``"_command"``, the exact
command that runs it). ``model`` is a sub-dict mapped onto the drafter kind's own
config class (the registry's ``config_class``: ``DSparkConfig`` for dspark/dflash,
``Eagle3Config`` for eagle3, ``DraftLMConfig`` for draft-lm, the distilled independent draft LM);
dotted override keys reach into it (``--set model.block_size=7``). Unknown keys
are errors, at both levels.

Presets live in ``dspark/configs/*.json`` (package data); ``--config`` takes a
preset name or a path.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark.target.loading import DTYPE_NAMES
from dspark.drafters.registry import KIND_NAMES, kind_entry
from dspark import presets
from dspark.errors import DSparkError
from dspark.presets import preset_names, read_preset  # noqa: F401  (preset_names: re-exported for the CLI)

#: the drafter kinds that train with a draft vocabulary (draft_vocab_size / draft_vocab_file)
DRAFT_VOCAB_KINDS = ("dspark", "dflash", "eagle3")

FEATURE_SOURCES = ("auto", "online", "cache")
DTYPES = DTYPE_NAMES


class TrainConfigError(DSparkError):
    """A training config or override the user wrote is invalid."""


RUN_LENGTH_FIELDS = ("max_steps", "epochs", "time_budget_s")  # a resume may extend a run (with a notice)


@dataclass
class TrainConfig:
    drafter: str = "dspark"  # a DrafterKind name: dspark | dflash | eagle3 | draft-lm
    target: str = "smollm2-135m"  # preset name or HF folder
    data: list[str] = field(default_factory=list)  # tokenized dataset path(s), for feature_source "online"
    out: str = "runs/train"
    model: dict[str, Any] = field(default_factory=dict)  # -> DSparkConfig / Eagle3Config / DraftLMConfig fields
    # optimisation (DeepSpec defaults, docs/interop.md §Training configs)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epochs: int = 1
    max_steps: int | None = None  # overrides epochs when set
    # global batch in sequences = world_size * grad_accum (one sequence per micro-batch, as DeepSpec)
    grad_accum: int | None = None
    global_batch_size: int | None = None  # alternative to grad_accum: grad_accum = global / world_size
    max_length: int = 4096  # sequences are truncated to this many tokens
    max_samples: int | None = None  # use only the first N samples of the data (quick runs)
    seed: int = 42
    checkpoint_every: int = 1000  # optimizer steps; a checkpoint is always written at the end
    keep_checkpoints: int = 0  # keep only the newest N step_* folders (0 = keep all)
    log_every: int = 10
    # auto: build the feature cache (cache_dir, else OUT/feature-cache) on the first pass when it fits on disk, then
    # read it | online: run the target per sample, every epoch | cache: read an existing cache (cache_dir)
    feature_source: str = "auto"
    # the feature cache (``dspark data features``) for feature_source "cache" / "auto"; several folders (a list) are
    # read as one dataset, e.g. regenerated answers and labelled text cached apart (all must exist)
    cache_dir: str | list[str] | None = None
    # held-out validation: the teacher-forced loss and metrics (val_loss, val_tau, val_acc@k) of the first
    # val_samples sequences of these feature caches (the same anchors every time), logged before the first step and
    # every val_every steps (default: at each checkpoint) and at the end; nothing is trained on them
    val_cache_dir: str | list[str] | None = None
    val_samples: int = 64
    val_every: int | None = None
    # DSpark/DFlash/Eagle3: draft only these tokens (LM-head and Markov rows over them; stored in the checkpoint):
    draft_vocab_size: int | None = None  # the N most frequent answer tokens of the training data
    draft_vocab_file: str | None = None  # or a `dspark data vocab` file
    # start from this checkpoint's weights (same kind; its architecture and draft vocabulary) with a fresh optimizer
    # and LR schedule: fine-tuning a drafter on new data, or a warm start from a shorter run (draft_vocab_* ignored)
    init_from: str | None = None
    dtype: str = "float32"  # drafter and target compute dtype; the optimizer keeps fp32 master weights
    device: str = "cpu"  # cpu | cuda | auto (`dspark train --device` sets it)
    save_dtype: str = "bfloat16"  # model.safetensors of each checkpoint (resume reads the fp32 master weights)
    # stop (with a checkpoint) at the first step boundary after this many seconds; the LR schedule then runs
    # over max(step fraction, time fraction), so warmup and cosine decay fit the budget
    time_budget_s: float | None = None  # stop (with a checkpoint) at the first step boundary after this many
    # seconds of training, counted across resumes: for equal-compute comparisons
    # stop (with a checkpoint) at the first step boundary after this many seconds of *this* session, leaving the
    # schedule (steps, or time_budget_s) alone: a long run split over sittings, each resumed with --resume
    session_time_s: float | None = None
    num_threads: int | None = None  # torch intra-op threads per process
    find_unused_parameters: bool = False  # DDP option, for models with parameters a loss may not touch
    # under torchrun: "ddp" replicates the drafter on every rank; "fsdp" shards it (FSDP2), and the frozen target's
    # decoder layers too (online features) or drops them (a feature cache); see
    # docs/training.md §Beyond one process: sharded features and FSDP
    parallel: str = "ddp"

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            self.data = [self.data]
        if isinstance(self.cache_dir, list) and len(self.cache_dir) == 1:
            self.cache_dir = self.cache_dir[0]
        if isinstance(self.val_cache_dir, list) and len(self.val_cache_dir) == 1:
            self.val_cache_dir = self.val_cache_dir[0]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> TrainConfigError:
            return TrainConfigError(f"training config: {msg}")

        if self.drafter not in KIND_NAMES:
            raise bad(f"drafter must be one of {', '.join(KIND_NAMES)}, got {self.drafter!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_file is not None:
            raise bad("set draft_vocab_size or draft_vocab_file, not both")
        if (self.draft_vocab_size is not None or self.draft_vocab_file) and self.drafter not in DRAFT_VOCAB_KINDS:
            raise bad(f"a draft vocabulary (draft_vocab_size / draft_vocab_file) is for "
                      f"{', '.join(DRAFT_VOCAB_KINDS)}, not {self.drafter}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise bad(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if isinstance(self.cache_dir, list) and not all(isinstance(c, str) and c for c in self.cache_dir):
            raise bad(f"cache_dir must be a folder or a list of folders, got {self.cache_dir!r}")
        if self.feature_source not in FEATURE_SOURCES:
            raise bad(f"feature_source must be one of {', '.join(FEATURE_SOURCES)}, got {self.feature_source!r}")
        if self.dtype not in DTYPES:
            raise bad(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.save_dtype not in DTYPES:
            raise bad(f"save_dtype must be one of {', '.join(DTYPES)}, got {self.save_dtype!r}")
        if self.grad_accum is not None and self.global_batch_size is not None:
            raise bad("set grad_accum or global_batch_size, not both")
        if isinstance(self.val_cache_dir, list) and not all(isinstance(c, str) and c for c in self.val_cache_dir):
            raise bad(f"val_cache_dir must be a folder or a list of folders, got {self.val_cache_dir!r}")
        for name in ("grad_accum", "global_batch_size", "max_steps", "max_samples", "num_threads", "val_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise bad(f"{name} must be >= 1, got {v}")
        for name in ("epochs", "max_length", "checkpoint_every", "log_every", "val_samples"):
            if getattr(self, name) < 1:
                raise bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise bad(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.keep_checkpoints < 0:
            raise bad(f"keep_checkpoints must be >= 0 (0 = keep all), got {self.keep_checkpoints}")
        if self.parallel not in ("ddp", "fsdp"):
            raise bad(f"parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise bad(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.time_budget_s is not None and self.time_budget_s < 0:
            raise bad(f"time_budget_s must be >= 0, got {self.time_budget_s}")
        if self.lr <= 0:
            raise bad(f"lr must be > 0, got {self.lr}")
        if not isinstance(self.model, dict):
            raise bad("model must be a JSON object of drafter config fields")

    def grad_accum_for(self, world_size: int) -> int:
        """Micro-batches (sequences) per rank per optimizer step."""
        if self.global_batch_size is None:
            return self.grad_accum or 1
        if self.global_batch_size % world_size:
            raise TrainConfigError(
                f"global_batch_size {self.global_batch_size} is not divisible by the {world_size} processes; "
                "change one of them or set grad_accum instead"
            )
        return self.global_batch_size // world_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def resume_mismatch(self, saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Fields of a checkpoint's ``train_config.json`` that a resume may not change: {field: (saved, now)}.

        A resume continues the same run, so what fixes the model, the data, their order and the schedule must
        match. How long to go on (``max_steps``, ``epochs``, ``time_budget_s``: the trainer says so when they
        change, since the LR schedule then follows the new length) and how the run is run and logged (threads,
        device, checkpointing, logging and validation, the saved dtype, ``out``) may change. A new stage on other data or
        settings starts from the weights with ``init_from`` instead."""
        free = {*RUN_LENGTH_FIELDS, "out", "session_time_s", "num_threads", "device", "checkpoint_every", "keep_checkpoints",
                "log_every", "save_dtype", "init_from", "find_unused_parameters", "val_cache_dir", "val_samples",
                "val_every"}
        now = self.to_dict()
        return {k: (saved[k], now[k]) for k in now if k not in free and k in saved and saved[k] != now[k]}


# ---------------------------------------------------------------- loading

def _read_config_source(name_or_path: str) -> dict[str, Any]:
    return read_preset(name_or_path, TrainConfigError)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` strings; ``model.x=v`` sets a model sub-config field."""
    return presets.apply_overrides(raw, overrides, TrainConfigError)


@functools.cache
def _type_hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _coerce(name: str, value: Any) -> Any:
    """Light type coercion for values from JSON/overrides (ints where floats are expected, etc.)."""
    hint = _type_hints()[name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = set(typing.get_args(hint)) if union else {hint}
    if value is None:
        if type(None) not in args:
            raise TrainConfigError(f"training config: {name} may not be null")
        return None
    if float in args and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if int in args and isinstance(value, float) and value.is_integer():
        return int(value)
    if list[str] in args and isinstance(value, str):
        return [value]
    ok = any(
        (a is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (a is int and isinstance(value, int) and not isinstance(value, bool))
        or (a is bool and isinstance(value, bool))
        or (a is str and isinstance(value, str))
        or (typing.get_origin(a) is list and isinstance(value, list))
        or (typing.get_origin(a) is dict and isinstance(value, dict))
        for a in args
    )
    if not ok:
        raise TrainConfigError(f"training config: {name} = {value!r} has the wrong type (expected {hint})")
    return value


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(k for k in raw if k not in known and not k.startswith("_"))
    if unknown:
        raise TrainConfigError(
            f"unknown training config key(s) {unknown}; valid keys: {', '.join(sorted(known))}"
        )
    values = {k: _coerce(k, v) for k, v in raw.items() if k in known}
    cfg = TrainConfig(**values)
    check_model_keys(cfg)
    return cfg


def load_config(name_or_path: str | None, overrides: list[str] = (), **fields: Any) -> TrainConfig:
    """Read a preset or JSON file, apply ``--set`` overrides, then explicit ``fields`` (CLI flags).

    Errors name the file (and the overrides, when there are any)."""
    raw = _read_config_source(name_or_path) if name_or_path else {}
    raw = apply_overrides(raw, list(overrides))
    raw.update({k: v for k, v in fields.items() if v is not None})
    try:
        cfg = config_from_dict(raw)
        build_model_config(cfg)  # the model sub-config's own checks, before anything is loaded
        return cfg
    except TrainConfigError as err:
        if not name_or_path:
            raise
        where = f"training config {name_or_path}" + (" with --set " + " ".join(overrides) if overrides else "")
        raise TrainConfigError(f"{where}: {str(err).removeprefix('training config: ')}") from None


# ---------------------------------------------------------------- model sub-config

def check_model_keys(cfg: TrainConfig) -> None:
    """Unknown ``model.*`` keys are errors."""
    known = {f.name for f in dataclasses.fields(kind_entry(cfg.drafter).config_class)}
    unknown = sorted(set(cfg.model) - known)
    if unknown:
        raise TrainConfigError(
            f"unknown model config key(s) {unknown} for drafter {cfg.drafter!r}; valid keys: {', '.join(sorted(known))}"
        )


def build_model_config(cfg: TrainConfig, default_layer_ids: list[int] | None = None):
    """The drafter's config object (``DSparkConfig``, ``DSparkConfig.dflash``, ``Eagle3Config``, ``DraftLMConfig``)."""
    check_model_keys(cfg)
    entry = kind_entry(cfg.drafter)
    kw = dict(cfg.model)
    reads_features = "target_layer_ids" in {f.name for f in dataclasses.fields(entry.config_class)}
    if reads_features and default_layer_ids is not None and kw.get("target_layer_ids") is None:
        kw["target_layer_ids"] = list(default_layer_ids)
    try:
        return entry.make_config(**kw)
    except (TypeError, ValueError) as err:
        raise TrainConfigError(f"model config for drafter {cfg.drafter!r}: {err}") from None
