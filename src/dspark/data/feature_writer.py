"""The bytes of a feature cache on disk: index records, shard files, resume after a kill, and the merge of
the parts that the ranks of a sharded build write (the layout is in ``features.py`` and docs/interop.md
§Feature cache).

A sharded build (``torchrun ... dspark data features``, W ranks) writes, per rank r, a complete
single-writer build into ``part-RRRRR/`` (its own samples.idx and shard files, resumable alone).
``merge_parts`` then moves every part's shards to the top folder under consecutive shard ids and
writes one ``samples.idx`` in sample-id order, so the finished folder is a cache like any other.
The merge is planned first (``merge.json``: which part shard becomes which shard id), so a merge
killed half-way finishes when the build is run again.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import torch

from dspark.errors import DSparkError

INDEX_RECORD = struct.Struct("<QIIQQQQQ")  # id, shard, seq_len, 5 byte offsets
INDEX_DTYPE = np.dtype([
    ("sample_id", "<u8"), ("shard_id", "<u4"), ("seq_len", "<u4"),
    ("input_ids", "<u8"), ("attention_mask", "<u8"), ("loss_mask", "<u8"),
    ("target_hidden_states", "<u8"), ("target_last_hidden_states", "<u8"),
])
assert INDEX_DTYPE.itemsize == INDEX_RECORD.size == 56
MERGE_PLAN = "merge.json"


class FeatureCacheError(DSparkError):
    """A feature cache folder is missing, incomplete, or does not fit the training run."""


def part_dir(out_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` of a sharded build writes its samples."""
    return Path(out_dir) / f"part-{rank:05d}"


def shard_path(folder: Path, shard_id: int) -> Path:
    return Path(folder) / f"shard-{shard_id:05d}.bin"


def atomic_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _bf16_bytes(x: torch.Tensor) -> bytes:
    return x.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy().tobytes()


class ShardWriter:
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
        # end of the last sample = start of its last hidden states + L * H bf16 values + L float32 log-sum-exps
        self.shard_size = int(rec["target_last_hidden_states"]) + int(rec["seq_len"]) * (self.hidden_size * 2 + 4)
        path = shard_path(self.out_dir, self.shard_id)
        if not path.exists() or path.stat().st_size < self.shard_size:
            raise FeatureCacheError(f"{path} is shorter than its index says; delete {self.out_dir} and rebuild")
        os.truncate(path, self.shard_size)
        for f in self.out_dir.glob("shard-*.bin"):
            if int(f.stem.split("-")[1]) > self.shard_id:
                f.unlink()
        self.shard = open(path, "ab")
        return n

    def _open_next_shard(self) -> None:
        if self.shard is not None:
            self.shard.close()
        self.shard_id += 1
        self.shard_size = 0
        self.shard = open(shard_path(self.out_dir, self.shard_id), "wb")

    def write(self, sample_id: int, input_ids: torch.Tensor, loss_mask: torch.Tensor,
              features: torch.Tensor, last_hidden: torch.Tensor, logsumexp: torch.Tensor) -> None:
        L = int(input_ids.numel())
        parts = [
            input_ids.to(torch.int32).numpy().tobytes(),
            np.ones(L, np.uint8).tobytes(),  # attention_mask
            loss_mask.to(torch.uint8).numpy().tobytes(),
            _bf16_bytes(features),
            _bf16_bytes(last_hidden),
            logsumexp.detach().to("cpu", torch.float32).numpy().tobytes(),  # after DeepSpec's five arrays
        ]
        total = sum(len(p) for p in parts)
        if self.shard is None or (self.shard_size > 0 and self.shard_size + total > self.max_shard_bytes):
            self._open_next_shard()
        offsets = []
        for p in parts:
            offsets.append(self.shard_size)  # the sixth (log-sum-exp) offset is implied: not in the index
            self.shard.write(p)
            self.shard_size += len(p)
        # the sample's bytes reach the file before its index record does
        self.shard.flush()
        self.index.write(INDEX_RECORD.pack(sample_id, self.shard_id, L, *offsets[:5]))
        self.index.flush()
        self.num_samples += 1

    def close(self) -> None:
        for f in (self.shard, self.index):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()


def merge_parts(out_dir: Path, world_size: int, num_samples: int) -> int:
    """Join the W parts of a sharded build into one cache folder; returns the number of shards.

    Shard ids are given part by part (part 0's shards first); the index is sorted by sample id, so
    sample i of the merged cache is item i of the dataset, as in a one-process build."""
    out_dir = Path(out_dir)
    parts = [np.fromfile(part_dir(out_dir, r) / "samples.idx", dtype=INDEX_DTYPE)
             if (part_dir(out_dir, r) / "samples.idx").exists() else np.zeros(0, INDEX_DTYPE)
             for r in range(world_size)]
    ids = np.sort(np.concatenate([p["sample_id"] for p in parts]))
    if not np.array_equal(ids, np.arange(num_samples)):
        raise FeatureCacheError(f"{out_dir}: the parts hold {len(ids)} samples, not the {num_samples} of the "
                                "dataset once each; rerun the build with the same number of processes")
    plan_path = out_dir / MERGE_PLAN
    if not plan_path.exists():
        counts = [int(p["shard_id"].max()) + 1 if len(p) else 0 for p in parts]
        atomic_json(plan_path, {"world_size": world_size, "part_shards": counts})
    counts = json.loads(plan_path.read_text())["part_shards"]
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (W+1,) first shard id of each part

    for r, part in enumerate(parts):
        folder = part_dir(out_dir, r)
        for s in range(counts[r]):  # a rename done before a kill is not redone
            src, dst = shard_path(folder, s), shard_path(out_dir, int(first[r]) + s)
            if src.exists():
                os.replace(src, dst)
            elif not dst.exists():
                raise FeatureCacheError(f"{src} is missing and was not merged; delete {out_dir} and rebuild")
        part["shard_id"] += int(first[r])
    index = np.concatenate(parts)
    index = index[np.argsort(index["sample_id"], kind="stable")]
    tmp = out_dir / "samples.idx.tmp"
    index.tofile(tmp)
    os.replace(tmp, out_dir / "samples.idx")
    return int(first[-1])


def remove_parts(out_dir: Path, world_size: int) -> None:
    """After the manifest is written: the parts' own index files and the merge plan go."""
    for r in range(world_size):
        shutil.rmtree(part_dir(out_dir, r), ignore_errors=True)
    (Path(out_dir) / MERGE_PLAN).unlink(missing_ok=True)
