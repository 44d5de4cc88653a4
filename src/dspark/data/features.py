"""Target features for drafter training: computed online, or cached on disk.

Online: ``compute_features`` runs the frozen target once over a sequence and
returns the outputs of ``target_layer_ids`` (concatenated) and the final-normed
hidden state. The drafter turns the latter into the target distribution with
the frozen LM head, so d numbers per token are kept, never V logits (docs/conventions.md §Target distribution in training).

Disk cache (``build_feature_cache`` / ``FeatureCacheDataset``): the sharded,
memory-mapped layout of DeepSpec's target cache, version 2 (docs/interop.md §Feature cache), so
either tool can read the other's cache:

- ``manifest.json``: version, num_samples, num_shards, target_layer_ids,
  hidden_dtype "bfloat16", token_dtype "int32", mask_dtype "uint8",
  index_record_size 56, hidden_size, shards [{shard_id, file_name}], plus
  target_model_name_or_path, source_jsonl_paths, max_length. Written last: a
  folder without it is an unfinished build.
- ``samples.idx``: one 56-byte little-endian record ``<QIIQQQQQ`` per sample:
  sample id, shard id, seq_len, then the byte offsets of the five arrays below.
- ``shard-NNNNN.bin``: raw bytes per sample, unpadded, in this order:
  input_ids int32[L], attention_mask u8[L] (all ones, kept for DeepSpec),
  loss_mask u8[L], target_hidden_states bf16[L, n*H], target_last_hidden_states
  bf16[L, H]. Never logits.

Our builds add, per sample right after target_last_hidden_states (DeepSpec's offset-based
reader skips it), ``target_logsumexp`` float32[L]: the log-sum-exp of the target's logits over
its whole vocabulary, computed from the stored bf16 last hidden state. With it the target's
distribution on a draft vocabulary costs W rows of the LM head per step, not V (manifest key
``target_logsumexp_dtype``; absent in DeepSpec's caches, then computed when a sample is read).
The manifest also records ``vocab_size``, ``num_target_layers`` and ``target_fingerprint``
(a few LM-head values), so a cache from another target is refused by name.

Bytes per token = 4 + 1 + 1 + 2*n*H + 2*H = 6 + 2H(n+1) (5 + 2H(n+1) without the
attention mask), + 4 with the log-sum-exp. SmolLM2-135M (H=576, n=5): 6 + 2*576*6 = 6,918
bytes/token (6,922 with it), i.e. about 6.9 GB per million tokens. Qwen3-4B (H=2560): 30,726.

Shapes: L = sequence length, H = hidden size, n = len(target_layer_ids),
F = n*H.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dspark.data.feature_writer import (  # noqa: F401  (INDEX_RECORD, FeatureCacheError: re-exported)
    INDEX_DTYPE,
    INDEX_RECORD,
    FeatureCacheError,
    ShardWriter,
    atomic_json,
    merge_parts,
    part_dir,
    remove_parts,
)
from dspark.drafters.checkpoint import check_fingerprint, target_fingerprint
from dspark.drafters.sample import TrainSample, target_logsumexp
from dspark.errors import DSparkError
from dspark.target.model import TargetModel

CACHE_VERSION = 2
DEFAULT_SHARD_BYTES = 64 * 2**30  # DeepSpec's shard cap
_BUILD_INFO = "build_info.json"


def bytes_per_token(hidden_size: int, num_layers: int, attention_mask: bool = True, logsumexp: bool = False) -> int:
    """Disk bytes per cached token: 6 + 2H(n+1) (5 + ... without the attention mask; + 4 with the log-sum-exp)."""
    return (6 if attention_mask else 5) + 2 * hidden_size * (num_layers + 1) + (4 if logsumexp else 0)


def labelling_dtype(device: str) -> str:
    """The dtype `dspark data features` runs the target in by default: bfloat16 on a GPU and on CPUs with bf16
    matmul units (about 3x float32 there, docs/reports/data-throughput.md; the cache stores bf16 either way and bf16 is
    what decoding runs), else float32."""
    from dspark.target.model import cpu_has_bf16_matmul

    return "bfloat16" if device.startswith("cuda") or (device == "cpu" and cpu_has_bf16_matmul()) else "float32"


# ---------------------------------------------------------------- online

def compute_features(
    target: TargetModel,
    input_ids: torch.Tensor,  # (L,) int64
    layer_ids: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:  # features (L, n*H), last_hidden (L, H)
    """One target pass over a fresh sequence (no KV cache, no logits)."""
    if input_ids.numel() > target.max_context:
        raise DSparkError(
            f"a training sequence has {input_ids.numel()} tokens but the target's context is "
            f"{target.max_context}; lower max_length"
        )
    out = target.forward(input_ids.long(), [input_ids.numel()], caches=None, capture_layers=list(layer_ids),
                         logits_for="none")
    # target.forward runs under inference_mode; clone into ordinary tensors autograd may save
    return out.features.clone(), out.last_hidden.clone()


class TokenSequences(Protocol):
    """What the feature code needs from a tokenized dataset."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...  # input_ids (L,), loss_mask (L,)


def _as_tensor(x: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).to(dtype)


def online_sample(
    target: TargetModel, item: dict[str, Any], layer_ids: list[int], max_length: int | None = None,
    dtype: torch.dtype = torch.float32, logsumexp: bool = False,
) -> TrainSample:
    """A ``TrainSample`` for one tokenized item, features (and with ``logsumexp`` the target's
    log-normaliser, for a draft vocabulary) computed by the target now."""
    input_ids = _as_tensor(item["input_ids"], torch.long)[:max_length]  # (L,)
    loss_mask = _as_tensor(item["loss_mask"], torch.long)[:max_length]  # (L,)
    features, last_hidden = compute_features(target, input_ids, layer_ids)
    lse = target_logsumexp(target, last_hidden) if logsumexp else None  # (L,)
    return TrainSample(input_ids=input_ids, loss_mask=loss_mask, target_features=features.to(dtype),
                       target_last_hidden=last_hidden.to(dtype), target_logsumexp=lse)


# ---------------------------------------------------------------- disk cache: writing

def build_feature_cache(
    target: TargetModel,
    dataset: TokenSequences,
    layer_ids: list[int],
    out_dir: str | Path,
    max_length: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    source_paths: list[str] | None = None,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    source_start: int = 0,
) -> Path:
    """Run the target over every sample and write the cache; rerun the same call to resume after a kill.

    ``dataset`` may be a slice of a larger tokenized set starting at item ``source_start`` (recorded, so a
    resume with another slice is refused). Before writing, the cache's size is printed and checked against the
    free disk space (``FeatureCacheError`` when it cannot fit); the progress bar shows target tokens per second.

    With ``world_size`` > 1 (every rank of an initialised ``torch.distributed`` group calls this) rank r
    labels samples r, r+W, r+2W, ... into its own part folder; rank 0 then merges the parts into one
    cache (``feature_writer.merge_parts``) that reads exactly like a one-process build. A sharded build
    resumes with the same number of ranks only."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    layer_ids = sorted(int(i) for i in layer_ids)
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise FeatureCacheError(f"target layer ids {bad} are outside the target's {target.num_layers} layers")
    info = {
        "target_model_name_or_path": str(target.path or target.name), "target_layer_ids": layer_ids,
        "hidden_size": target.hidden_size, "num_source_samples": len(dataset), "max_length": max_length,
        "source_jsonl_paths": [str(p) for p in (source_paths or [])], "target_logsumexp_dtype": "float32",
        "vocab_size": target.vocab_size, "num_target_layers": target.num_layers,
        "target_fingerprint": target_fingerprint(target), "world_size": world_size, "source_start": source_start,
    }
    if (out_dir / "manifest.json").exists():
        _check_build_info(out_dir, info, finished=True)
        return out_dir  # already complete
    if rank == 0:
        _open_build_folder(out_dir, info)
        _check_disk(out_dir, dataset, layer_ids, target.hidden_size, max_length, progress)
    _barrier(world_size)
    if rank != 0:
        _check_build_info(out_dir, info)
    sharded = world_size > 1
    folder = part_dir(out_dir, rank) if sharded else out_dir
    merging = sharded and (out_dir / "merge.json").exists()  # a killed merge: the labelling is done
    indices = range(rank, len(dataset), world_size)  # this rank's samples
    if not merging:
        folder.mkdir(exist_ok=True)
        writer = ShardWriter(folder, target.hidden_size, max_shard_bytes)
        bar = tqdm(total=len(indices), initial=writer.num_samples, desc="target features", unit="seq",
                   disable=not progress or rank != 0, dynamic_ncols=True)
        tokens, t0 = 0, time.perf_counter()
        try:
            for i in indices[writer.num_samples:]:
                tokens += _write_sample(target, dataset[i], i, layer_ids, max_length, writer)
                bar.update(1)
                bar.set_postfix_str(f"{tokens * world_size / max(time.perf_counter() - t0, 1e-9):.0f} tok/s",
                                    refresh=False)
        finally:
            bar.close()
            writer.close()
    _barrier(world_size)
    if rank == 0:
        num_shards = merge_parts(out_dir, world_size, len(dataset)) if sharded else writer.shard_id + 1
        _write_manifest(out_dir, info, len(dataset), num_shards)
        if sharded:
            remove_parts(out_dir, world_size)
    _barrier(world_size)
    return out_dir


def join_ranks() -> tuple[int, int]:
    """(rank, world size): under ``torchrun`` this process joins a gloo group (the build only meets at
    barriers, so ranks may label for hours before they wait); (0, 1) in a single process. A rank on a
    GPU machine takes GPU ``LOCAL_RANK`` as its current device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import datetime

    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=1))
    return dist.get_rank(), world


def leave_ranks() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _barrier(world_size: int) -> None:
    if world_size > 1:
        torch.distributed.barrier()


def _open_build_folder(out_dir: Path, info: dict) -> None:
    """A new build needs an empty (or new) folder; an unfinished one must have been started alike."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / _BUILD_INFO).exists():
        _check_build_info(out_dir, info)
    elif any(out_dir.iterdir()):
        raise FeatureCacheError(f"{out_dir} is not empty and holds no unfinished feature cache; use a new folder")
    else:
        atomic_json(out_dir / _BUILD_INFO, info)


def sequence_lengths(dataset: TokenSequences, max_length: int | None = None) -> np.ndarray:  # (N,) int64
    """Tokens per sequence as the cache stores them (cut at ``max_length``)."""
    lengths = getattr(dataset, "lengths", None)  # a TokenizedDataset knows them without reading the tokens
    inner = getattr(dataset, "dataset", None)  # a Subset of one
    if lengths is None and getattr(inner, "lengths", None) is not None:
        lengths = np.asarray(inner.lengths)[np.asarray(dataset.indices)]
    parts = getattr(dataset, "datasets", None)  # a ConcatDataset of them
    if lengths is None and parts and all(getattr(p, "lengths", None) is not None for p in parts):
        lengths = np.concatenate([np.asarray(p.lengths) for p in parts])
    if lengths is None or len(lengths) != len(dataset):
        lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths if max_length is None else np.minimum(lengths, max_length)


def planned_cache_bytes(dataset: TokenSequences, num_layers: int, hidden_size: int,
                        max_length: int | None = None) -> tuple[int, int]:
    """(tokens, bytes) of the finished cache of ``dataset``: index records plus per-token payload."""
    tokens = int(sequence_lengths(dataset, max_length).sum())
    per_token = bytes_per_token(hidden_size, num_layers, logsumexp=True)
    return tokens, tokens * per_token + len(dataset) * INDEX_RECORD.size


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _check_disk(out_dir: Path, dataset: TokenSequences, layer_ids: list[int], hidden_size: int,
                max_length: int | None, progress: bool) -> None:
    """State the cache's size before writing it, and refuse a build the disk cannot hold."""
    import shutil

    tokens, total = planned_cache_bytes(dataset, len(layer_ids), hidden_size, max_length)
    written = _folder_bytes(out_dir)
    free = shutil.disk_usage(out_dir).free
    gib = 2**30
    if progress:
        print(f"feature cache {out_dir}: {len(dataset)} sequences, {tokens:,} tokens, "
              f"{total / gib:.1f} GiB ({bytes_per_token(hidden_size, len(layer_ids), logsumexp=True):,} B/token); "
              f"{written / gib:.1f} GiB already written, {free / gib:.1f} GiB free", file=sys.stderr, flush=True)
    if total - written > free:
        raise FeatureCacheError(
            f"{out_dir}: the feature cache needs {(total - written) / gib:.1f} GiB more but the disk has "
            f"{free / gib:.1f} GiB free; free space, use another --out, or cache fewer sequences (--limit)"
        )


def _write_sample(target: TargetModel, item: dict[str, Any], sample_id: int, layer_ids: list[int],
                  max_length: int | None, writer: ShardWriter) -> int:
    input_ids = _as_tensor(item["input_ids"], torch.long)[:max_length]  # (L,)
    loss_mask = _as_tensor(item["loss_mask"], torch.long)[:max_length]  # (L,)
    features, last_hidden = compute_features(target, input_ids, layer_ids)  # (L, F), (L, H)
    last_hidden = last_hidden.to(torch.bfloat16)  # as stored: the log-sum-exp must match what is read
    lse = target_logsumexp(target, last_hidden)  # (L,)
    writer.write(sample_id, input_ids, loss_mask, features, last_hidden, lse)
    return int(input_ids.numel())


def _write_manifest(out_dir: Path, info: dict, num_samples: int, num_shards: int) -> None:
    """Written last: a folder without manifest.json is an unfinished build."""
    layer_ids, hidden_size = info["target_layer_ids"], info["hidden_size"]
    manifest = {
        "version": CACHE_VERSION, "num_samples": num_samples, "num_shards": num_shards,
        "target_layer_ids": layer_ids, "hidden_dtype": "bfloat16", "token_dtype": "int32",
        "mask_dtype": "uint8", "index_record_size": INDEX_RECORD.size, "hidden_size": hidden_size,
        "shards": [{"shard_id": s, "file_name": f"shard-{s:05d}.bin"} for s in range(num_shards)],
        "target_model_name_or_path": info["target_model_name_or_path"],
        "source_jsonl_paths": info["source_jsonl_paths"], "max_length": info["max_length"],
        "bytes_per_token": bytes_per_token(hidden_size, len(layer_ids), logsumexp=True),
        **{k: info[k] for k in ("target_logsumexp_dtype", "vocab_size", "num_target_layers", "target_fingerprint")},
    }
    atomic_json(out_dir / "manifest.json", manifest)


def _check_build_info(out_dir: Path, info: dict, finished: bool = False) -> None:
    path = out_dir / _BUILD_INFO
    if not path.exists():
        return
    old = json.loads(path.read_text())
    keys = ("target_layer_ids", "hidden_size", "num_source_samples", "max_length", "target_logsumexp_dtype",
            "vocab_size", "source_start")
    old.setdefault("source_start", 0)  # builds from before slices started at the first item
    diff = [k for k in keys if old.get(k) != info[k]]
    ranks = old.get("world_size", 1)  # builds from before sharding were one process
    if not diff and not finished and ranks != info["world_size"]:  # each rank resumes its own part
        raise FeatureCacheError(
            f"{out_dir} holds an unfinished feature cache built by {ranks} process(es); resume it with the "
            f"same number (torchrun --nproc_per_node {ranks}), not {info['world_size']}, or use a new folder"
        )
    if diff:
        raise FeatureCacheError(
            f"{out_dir} holds a feature cache built with different {', '.join(diff)} "
            f"({ {k: old.get(k) for k in diff} } vs { {k: info[k] for k in diff} }); use a new folder"
        )


# ---------------------------------------------------------------- disk cache: reading

class FeatureCacheDataset:
    """Random access to a finished cache; samples come back as ``TrainSample`` (features as ``dtype``)."""

    def __init__(self, cache_dir: str | Path, dtype: torch.dtype = torch.float32,
                 max_length: int | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.manifest = load_manifest(self.cache_dir)
        self.dtype = dtype
        self.max_length = max_length
        self.hidden_size = int(self.manifest["hidden_size"])
        self.target_layer_ids = [int(i) for i in self.manifest["target_layer_ids"]]
        self.has_logsumexp = self.manifest.get("target_logsumexp_dtype") == "float32"
        self.index = np.fromfile(self.cache_dir / "samples.idx", dtype=INDEX_DTYPE)
        self._shards: dict[int, np.memmap] = {}
        self._layer_pick: list[int] | None = None  # positions of the read layers among the stored ones
        check_index(self.cache_dir, self.manifest, self.index, self.has_logsumexp)

    def select_layers(self, layer_ids: list[int]) -> None:
        """Read only these of the stored target layers (in this order): one cache of 5 layers serves a drafter
        that fuses 3 of them, e.g. an Eagle3 that exports to vLLM. ``check_cache_fits`` refuses ids not stored."""
        stored = self.target_layer_ids
        missing = [i for i in layer_ids if i not in stored]
        if missing:
            raise FeatureCacheError(f"{self.cache_dir} stores target layers {stored}, not {missing}")
        self._layer_pick = None if list(layer_ids) == stored else [stored.index(i) for i in layer_ids]

    def __len__(self) -> int:
        return len(self.index)

    def _shard(self, shard_id: int) -> np.memmap:
        if shard_id not in self._shards:
            name = self.manifest["shards"][shard_id]["file_name"]
            self._shards[shard_id] = np.memmap(self.cache_dir / name, dtype=np.uint8, mode="r")
        return self._shards[shard_id]

    def seq_len(self, index: int) -> int:
        return int(self.index[index]["seq_len"])

    def __getitem__(self, index: int) -> TrainSample:
        rec = self.index[index]
        L, H = int(rec["seq_len"]), self.hidden_size
        F = H * len(self.target_layer_ids)
        mm = self._shard(int(rec["shard_id"]))

        def view(field: str, np_dtype, count: int) -> np.ndarray:
            start = int(rec[field])
            return mm[start : start + count * np.dtype(np_dtype).itemsize].view(np_dtype)

        def bf16(field: str, width: int) -> torch.Tensor:
            raw = torch.from_numpy(view(field, np.uint16, L * width).copy())
            return raw.view(torch.bfloat16).reshape(L, width)

        keep = L if self.max_length is None else min(L, self.max_length)
        lse = None
        if self.has_logsumexp:  # float32[L] right after the last hidden states
            start = int(rec["target_last_hidden_states"]) + L * H * 2
            lse = torch.from_numpy(mm[start : start + 4 * L].view(np.float32).copy())[:keep]  # (L,)
        features = bf16("target_hidden_states", F)[:keep]  # (L, F)
        if self._layer_pick is not None:  # (L, n, H) -> the chosen layers (L, n'H)
            features = features.view(-1, len(self.target_layer_ids), H)[:, self._layer_pick].reshape(keep, -1)
        return TrainSample(
            input_ids=torch.from_numpy(view("input_ids", np.int32, L).astype(np.int64))[:keep],  # (L,)
            loss_mask=torch.from_numpy(view("loss_mask", np.uint8, L).astype(np.int64))[:keep],  # (L,)
            target_features=features.to(self.dtype),  # (L, F)
            target_last_hidden=bf16("target_last_hidden_states", H)[:keep].to(self.dtype),  # (L, H)
            target_logsumexp=lse,
        )


def load_manifest(cache_dir: Path) -> dict:
    path = Path(cache_dir) / "manifest.json"
    if not path.exists():
        hint = " (an unfinished build: rerun `dspark data features` with the same arguments to finish it)" \
            if (Path(cache_dir) / _BUILD_INFO).exists() else ""
        raise FeatureCacheError(f"{cache_dir} has no manifest.json{hint}")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FeatureCacheError(f"{path} is not readable JSON ({err}); the cache is damaged, rebuild it") from None
    if not isinstance(m, dict):
        raise FeatureCacheError(f"{path} is not a feature-cache manifest (a JSON object)")
    missing = sorted({"version", "num_samples", "num_shards", "target_layer_ids", "hidden_dtype", "token_dtype",
                      "mask_dtype", "index_record_size", "hidden_size", "shards"} - set(m))
    if missing:
        raise FeatureCacheError(f"{path} lacks fields {missing}")
    if int(m["version"]) != CACHE_VERSION or m["hidden_dtype"] != "bfloat16" or m["token_dtype"] != "int32" \
            or m["mask_dtype"] != "uint8" or int(m["index_record_size"]) != INDEX_RECORD.size:
        raise FeatureCacheError(
            f"{path}: unsupported cache format (version {m['version']}, hidden {m['hidden_dtype']}); "
            "this reader supports version 2 with bfloat16 hidden states"
        )
    if int(m["num_samples"]) < 1:
        raise FeatureCacheError(f"{path}: the feature cache is empty (0 samples); build it from a non-empty dataset")
    idx = Path(cache_dir) / "samples.idx"
    if not idx.exists() or idx.stat().st_size != int(m["num_samples"]) * INDEX_RECORD.size:
        raise FeatureCacheError(f"{idx} does not hold {m['num_samples']} records; the cache is damaged")
    for s in m["shards"]:
        if not (Path(cache_dir) / s["file_name"]).exists():
            raise FeatureCacheError(f"{cache_dir}: shard {s['file_name']} is missing")
    return m


def check_index(cache_dir: Path, manifest: dict, index: np.ndarray, logsumexp: bool) -> None:
    """Every index record must point inside an existing shard (a truncated or overwritten shard is refused)."""
    H, n = int(manifest["hidden_size"]), len(manifest["target_layer_ids"])
    shards = manifest["shards"]
    bad = index["shard_id"] >= len(shards)
    if bad.any():
        raise FeatureCacheError(f"{cache_dir}/samples.idx: sample {int(bad.argmax())} names shard "
                                f"{int(index['shard_id'][bad.argmax()])}, the manifest lists {len(shards)}; damaged")
    L = index["seq_len"].astype(np.int64)
    ends = index["target_last_hidden_states"].astype(np.int64) + L * (2 * H + (4 if logsumexp else 0))
    order = [index["input_ids"], index["attention_mask"], index["loss_mask"], index["target_hidden_states"],
             index["target_last_hidden_states"]]
    sizes = [L * 4, L, L, L * 2 * n * H]
    ok = np.ones(len(index), dtype=bool)
    for (a, b), size in zip(zip(order, order[1:]), sizes):
        ok &= a.astype(np.int64) + size == b.astype(np.int64)
    for s, shard in enumerate(shards):
        mine = index["shard_id"] == s
        if not mine.any():
            continue
        file = Path(cache_dir) / shard["file_name"]
        if int(ends[mine].max()) > file.stat().st_size:
            raise FeatureCacheError(f"{file} is shorter than samples.idx says (truncated?); the cache is damaged, "
                                    "rebuild it")
    if not ok.all():
        raise FeatureCacheError(f"{cache_dir}/samples.idx: record {int((~ok).argmax())} has inconsistent offsets; "
                                "the cache is damaged, rebuild it")


def check_cache_fits(manifest: dict, layer_ids: list[int], hidden_size: int, target=None,
                     cache_dir: str | Path = "the feature cache") -> None:
    """The cache must hold the layers and width the drafter reads, and (when it says) come from ``target``."""
    where = f"{cache_dir}/manifest.json" if cache_dir != "the feature cache" else cache_dir
    stored = [int(i) for i in manifest["target_layer_ids"]]
    if not set(int(i) for i in layer_ids) <= set(stored):  # a subset is read by FeatureCacheDataset.select_layers
        raise FeatureCacheError(
            f"{where} holds target layers {manifest['target_layer_ids']} but the drafter reads "
            f"{list(layer_ids)}; rebuild the cache or set model.target_layer_ids to (a subset of) them"
        )
    if int(manifest["hidden_size"]) != hidden_size:
        raise FeatureCacheError(
            f"{where} has hidden size {manifest['hidden_size']}, the target {hidden_size}: "
            "it was built from another target"
        )
    if target is None:
        return
    for key, mine in (("vocab_size", target.vocab_size), ("num_target_layers", target.num_layers)):
        if manifest.get(key) is not None and int(manifest[key]) != mine:
            raise FeatureCacheError(f"{where} has {key} {manifest[key]}, the target {mine}: "
                                    "it was built from another target")
    try:
        check_fingerprint(str(where), manifest.get("target_fingerprint"), target, "target_fingerprint")
    except DSparkError as err:
        raise FeatureCacheError(str(err).replace("was trained for", "was built from")) from None
