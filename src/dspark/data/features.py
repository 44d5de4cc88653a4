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

Bytes per token = 4 + 1 + 1 + 2*n*H + 2*H = 6 + 2H(n+1) (5 + 2H(n+1) without the
attention mask). SmolLM2-135M (H=576, n=5): 6 + 2*576*6 = 6,918 bytes/token,
i.e. about 6.9 GB per million tokens. Qwen3-4B (H=2560): 30,726 bytes/token.

Shapes: L = sequence length, H = hidden size, n = len(target_layer_ids),
F = n*H.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dspark.errors import DSparkError
from dspark.target.model import TargetModel
from dspark.drafters.sample import TrainSample

CACHE_VERSION = 2
INDEX_RECORD = struct.Struct("<QIIQQQQQ")  # id, shard, seq_len, 5 byte offsets
INDEX_DTYPE = np.dtype([
    ("sample_id", "<u8"), ("shard_id", "<u4"), ("seq_len", "<u4"),
    ("input_ids", "<u8"), ("attention_mask", "<u8"), ("loss_mask", "<u8"),
    ("target_hidden_states", "<u8"), ("target_last_hidden_states", "<u8"),
])
assert INDEX_DTYPE.itemsize == INDEX_RECORD.size == 56
DEFAULT_SHARD_BYTES = 64 * 2**30  # DeepSpec's shard cap
_BUILD_INFO = "build_info.json"


class FeatureCacheError(DSparkError):
    """A feature cache folder is missing, incomplete, or does not fit the training run."""


def bytes_per_token(hidden_size: int, num_layers: int, attention_mask: bool = True) -> int:
    """Disk bytes per cached token: 6 + 2H(n+1) (5 + ... without the attention mask)."""
    return (6 if attention_mask else 5) + 2 * hidden_size * (num_layers + 1)


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
    dtype: torch.dtype = torch.float32,
) -> TrainSample:
    """A ``TrainSample`` for one tokenized item, features computed by the target now."""
    input_ids = _as_tensor(item["input_ids"], torch.long)[:max_length]  # (L,)
    loss_mask = _as_tensor(item["loss_mask"], torch.long)[:max_length]  # (L,)
    features, last_hidden = compute_features(target, input_ids, layer_ids)
    return TrainSample(input_ids=input_ids, loss_mask=loss_mask,
                       target_features=features.to(dtype), target_last_hidden=last_hidden.to(dtype))


# ---------------------------------------------------------------- disk cache: writing

def _bf16_bytes(x: torch.Tensor) -> bytes:
    return x.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy().tobytes()


class _ShardWriter:
    """Appends samples to shard files and index records to samples.idx."""

    def __init__(self, out_dir: Path, hidden_size: int, max_shard_bytes: int) -> None:
        self.out_dir = out_dir
        self.hidden_size = hidden_size
        self.max_shard_bytes = max_shard_bytes
        self.index_path = out_dir / "samples.idx"
        self.shard_id, self.shard_size = -1, 0
        self.shard = None
        self.num_samples = self._recover()
        self.index = open(self.index_path, "ab")

    def _recover(self) -> int:
        """Resume after a kill: keep whole index records, cut the last shard after the last sample."""
        if not self.index_path.exists():
            return 0
        size = self.index_path.stat().st_size
        n = size // INDEX_RECORD.size
        os.truncate(self.index_path, n * INDEX_RECORD.size)
        if n == 0:
            for f in self.out_dir.glob("shard-*.bin"):
                f.unlink()
            return 0
        with open(self.index_path, "rb") as f:
            f.seek((n - 1) * INDEX_RECORD.size)
            rec = np.frombuffer(f.read(INDEX_RECORD.size), INDEX_DTYPE)[0]
        self.shard_id = int(rec["shard_id"])
        # end of the last sample = start of its last array + L * H bf16 values
        self.shard_size = int(rec["target_last_hidden_states"]) + int(rec["seq_len"]) * self.hidden_size * 2
        path = self._shard_path(self.shard_id)
        if not path.exists() or path.stat().st_size < self.shard_size:
            raise FeatureCacheError(f"{path} is shorter than its index says; delete {self.out_dir} and rebuild")
        os.truncate(path, self.shard_size)
        for f in self.out_dir.glob("shard-*.bin"):
            if int(f.stem.split("-")[1]) > self.shard_id:
                f.unlink()
        self.shard = open(path, "ab")
        return n

    def _shard_path(self, shard_id: int) -> Path:
        return self.out_dir / f"shard-{shard_id:05d}.bin"

    def _open_next_shard(self) -> None:
        if self.shard is not None:
            self.shard.close()
        self.shard_id += 1
        self.shard_size = 0
        self.shard = open(self._shard_path(self.shard_id), "wb")

    def write(self, sample_id: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
              features: torch.Tensor, last_hidden: torch.Tensor) -> None:
        L = int(input_ids.numel())
        parts = [
            input_ids.to(torch.int32).numpy().tobytes(),
            np.ones(L, np.uint8).tobytes(),  # attention_mask
            loss_mask.to(torch.uint8).numpy().tobytes(),
            _bf16_bytes(features),
            _bf16_bytes(last_hidden),
        ]
        total = sum(len(p) for p in parts)
        if self.shard is None or (self.shard_size > 0 and self.shard_size + total > self.max_shard_bytes):
            self._open_next_shard()
        offsets = []
        for p in parts:
            offsets.append(self.shard_size)
            self.shard.write(p)
            self.shard_size += len(p)
        # the sample's bytes reach the file before its index record does
        self.shard.flush()
        self.index.write(INDEX_RECORD.pack(sample_id, self.shard_id, L, *offsets))
        self.index.flush()
        self.num_samples += 1

    def close(self) -> None:
        for f in (self.shard, self.index):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()


def _atomic_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp, path)


def build_feature_cache(
    target: TargetModel,
    dataset: TokenSequences,
    layer_ids: list[int],
    out_dir: str | Path,
    max_length: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    source_paths: list[str] | None = None,
    progress: bool = True,
) -> Path:
    """Run the target over every sample and write the cache; rerun the same call to resume after a kill."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    layer_ids = sorted(int(i) for i in layer_ids)
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise FeatureCacheError(f"target layer ids {bad} are outside the target's {target.num_layers} layers")
    info = {
        "target_model_name_or_path": str(target.path or target.name), "target_layer_ids": layer_ids,
        "hidden_size": target.hidden_size, "num_source_samples": len(dataset), "max_length": max_length,
        "source_jsonl_paths": [str(p) for p in (source_paths or [])],
    }
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        _check_build_info(out_dir, info)
        return out_dir  # already complete
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / _BUILD_INFO).exists():
        _check_build_info(out_dir, info)
    elif any(out_dir.iterdir()):
        raise FeatureCacheError(f"{out_dir} is not empty and holds no unfinished feature cache; use a new folder")
    else:
        _atomic_json(out_dir / _BUILD_INFO, info)

    writer = _ShardWriter(out_dir, target.hidden_size, max_shard_bytes)
    start = writer.num_samples
    bar = tqdm(total=len(dataset), initial=start, desc="target features", unit="seq", disable=not progress,
               dynamic_ncols=True)
    try:
        for i in range(start, len(dataset)):
            item = dataset[i]
            input_ids = _as_tensor(item["input_ids"], torch.long)[:max_length]  # (L,)
            loss_mask = _as_tensor(item["loss_mask"], torch.long)[:max_length]  # (L,)
            features, last_hidden = compute_features(target, input_ids, layer_ids)  # (L, F), (L, H)
            writer.write(i, input_ids, loss_mask, features, last_hidden)
            bar.update(1)
            bar.set_postfix(tokens=int(input_ids.numel()))
    finally:
        bar.close()
        writer.close()
    manifest = {
        "version": CACHE_VERSION, "num_samples": writer.num_samples, "num_shards": writer.shard_id + 1,
        "target_layer_ids": layer_ids, "hidden_dtype": "bfloat16", "token_dtype": "int32",
        "mask_dtype": "uint8", "index_record_size": INDEX_RECORD.size, "hidden_size": target.hidden_size,
        "shards": [{"shard_id": s, "file_name": f"shard-{s:05d}.bin"} for s in range(writer.shard_id + 1)],
        "target_model_name_or_path": info["target_model_name_or_path"],
        "source_jsonl_paths": info["source_jsonl_paths"], "max_length": max_length,
        "bytes_per_token": bytes_per_token(target.hidden_size, len(layer_ids)),
    }
    _atomic_json(manifest_path, manifest)
    return out_dir


def _check_build_info(out_dir: Path, info: dict) -> None:
    path = out_dir / _BUILD_INFO
    if not path.exists():
        return
    old = json.loads(path.read_text())
    diff = [k for k in ("target_layer_ids", "hidden_size", "num_source_samples", "max_length") if old.get(k) != info[k]]
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
        self.index = np.fromfile(self.cache_dir / "samples.idx", dtype=INDEX_DTYPE)
        self._shards: dict[int, np.memmap] = {}

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
        return TrainSample(
            input_ids=torch.from_numpy(view("input_ids", np.int32, L).astype(np.int64))[:keep],  # (L,)
            loss_mask=torch.from_numpy(view("loss_mask", np.uint8, L).astype(np.int64))[:keep],  # (L,)
            target_features=bf16("target_hidden_states", F)[:keep].to(self.dtype),  # (L, F)
            target_last_hidden=bf16("target_last_hidden_states", H)[:keep].to(self.dtype),  # (L, H)
        )


def load_manifest(cache_dir: Path) -> dict:
    path = Path(cache_dir) / "manifest.json"
    if not path.exists():
        hint = " (an unfinished build: rerun `dspark data features` with the same arguments to finish it)" \
            if (Path(cache_dir) / _BUILD_INFO).exists() else ""
        raise FeatureCacheError(f"{cache_dir} has no manifest.json{hint}")
    m = json.loads(path.read_text())
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
    idx = Path(cache_dir) / "samples.idx"
    if not idx.exists() or idx.stat().st_size != int(m["num_samples"]) * INDEX_RECORD.size:
        raise FeatureCacheError(f"{idx} does not hold {m['num_samples']} records; the cache is damaged")
    for s in m["shards"]:
        if not (Path(cache_dir) / s["file_name"]).exists():
            raise FeatureCacheError(f"{cache_dir}: shard {s['file_name']} is missing")
    return m


def check_cache_fits(manifest: dict, layer_ids: list[int], hidden_size: int) -> None:
    """The cache must hold the layers and width the drafter reads."""
    if [int(i) for i in manifest["target_layer_ids"]] != [int(i) for i in layer_ids]:
        raise FeatureCacheError(
            f"the feature cache holds target layers {manifest['target_layer_ids']} but the drafter reads "
            f"{list(layer_ids)}; rebuild the cache or set model.target_layer_ids to match"
        )
    if int(manifest["hidden_size"]) != hidden_size:
        raise FeatureCacheError(
            f"the feature cache has hidden size {manifest['hidden_size']}, the target {hidden_size}: "
            "it was built from another target"
        )
