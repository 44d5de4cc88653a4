"""Tokenized training conversations on disk, a torch Dataset over them, and length-bucketed batches.

On-disk layout of a tokenized folder:
  manifest.json   format version, counts, tokenizer, max_length, min_loss_tokens, sources, dropped
  input_ids.npy   int32  (T,)    all samples' tokens, concatenated
  loss_mask.npy   uint8  (T,)    1 on assistant reply tokens, 2 (TARGET_LABEL) on those of teacher-forced
                                 records (chat.tokenize_conversation); read "supervised" as != 0
  offsets.npy     int64  (N+1,)  sample i is [offsets[i], offsets[i+1])
The arrays are memory-mapped when read, so a dataset larger than RAM works.

Input JSONL records have the DeepSpec shape `{"id", "conversations": [{"role", "content"}, ...],
"status": "success"}`; records whose status is anything other than "success" are skipped (records
without a status, e.g. hand-written conversations, are used). Records with `"label": "teacher_forced"`
(`dspark data label`) get loss-mask value 2 on their replies; the manifest counts both kinds.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from dspark.errors import BadFileError, DSparkError
from dspark.data.chat import MIN_LOSS_TOKENS, reply_mask_value, tokenize_conversation
from dspark.drafters.losses import TARGET_LABEL

FORMAT_VERSION = 1


@dataclass
class TokenizeSummary:
    path: Path
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    skipped: dict[str, int]
    num_labelled_tokens: int = 0  # of num_loss_tokens: teacher-forced (loss_mask TARGET_LABEL)

    def __str__(self) -> str:
        labelled = f", {self.num_labelled_tokens} of them teacher-forced" if self.num_labelled_tokens else ""
        return (f"wrote {self.num_samples} samples ({self.num_tokens} tokens, {self.num_loss_tokens} "
                f"supervised{labelled}) to {self.path}; skipped {self.skipped}")


def _records(path: Path):
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise DSparkError(f"{path}:{line_no} is not valid JSON ({err})") from err


def write_tokenized(jsonl_in: str | Path | list[str | Path], tokenizer, out_path: str | Path, max_length: int,
                    min_loss_tokens: int = MIN_LOSS_TOKENS, progress: bool = True) -> TokenizeSummary:
    """Tokenize regenerated conversations into a folder `TokenizedDataset` reads (layout above)."""
    from tqdm.auto import tqdm

    paths = [Path(p) for p in (jsonl_in if isinstance(jsonl_in, list) else [jsonl_in])]
    for path in paths:
        if not path.is_file():
            raise DSparkError(f"{path} does not exist; give the regenerated-responses JSONL")
    ids_parts: list[np.ndarray] = []  # (L_i,) each
    mask_parts: list[np.ndarray] = []
    skipped: Counter = Counter()
    for path in paths:
        for record in tqdm(_records(path), desc=f"tokenize {path.name}", unit="sample", disable=not progress):
            if record.get("status", "success") != "success":
                skipped["status"] += 1
                continue
            conversations = record.get("conversations")
            if not conversations or not any(m.get("role") == "assistant" for m in conversations):
                skipped["no_assistant_turn"] += 1
                continue
            sample = tokenize_conversation(tokenizer, conversations, max_length, min_loss_tokens,
                                           reply_mask_value(record))
            if sample is None:
                skipped["few_loss_tokens"] += 1
                continue
            ids_parts.append(np.asarray(sample["input_ids"], dtype=np.int32))
            mask_parts.append(np.asarray(sample["loss_mask"], dtype=np.uint8))
    if not ids_parts:
        raise DSparkError(f"no usable samples in {', '.join(map(str, paths))} (skipped: {dict(skipped)})")
    lengths = np.array([len(a) for a in ids_parts], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # (N+1,)
    input_ids = np.concatenate(ids_parts)  # (T,)
    loss_mask = np.concatenate(mask_parts)  # (T,)
    manifest = {
        "format": "dspark-tokenized", "version": FORMAT_VERSION,
        "num_samples": int(len(lengths)), "num_tokens": int(offsets[-1]),
        "num_loss_tokens": int(np.count_nonzero(loss_mask)),
        "num_loss_tokens_regenerated": int(np.count_nonzero(loss_mask == 1)),
        "num_loss_tokens_labelled": int(np.count_nonzero(loss_mask == TARGET_LABEL)), "max_length": max_length,
        "min_loss_tokens": min_loss_tokens, "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer), "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "source_jsonl_paths": [str(p) for p in paths], "skipped": dict(skipped),
    }
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.save(tmp / "input_ids.npy", input_ids)
    np.save(tmp / "loss_mask.npy", loss_mask)
    np.save(tmp / "offsets.npy", offsets)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(out_path, ignore_errors=True)
    tmp.rename(out_path)
    return TokenizeSummary(out_path, manifest["num_samples"], manifest["num_tokens"],
                           manifest["num_loss_tokens"], dict(skipped), manifest["num_loss_tokens_labelled"])


_PROBE = "Tokenizer check: def f(x):\n    return x ** 2  # 12,345 ü é 中文 🙂 <|im_start|>"


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of how ``tokenizer`` splits a probe text (code, digits, accents, CJK, emoji, a chat marker)
    and of its size and special ids: data tokenized by another tokenizer gives another value."""
    import hashlib

    probe = [len(tokenizer), list(tokenizer.encode(_PROBE, add_special_tokens=False)),
             getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    return hashlib.sha256(json.dumps(probe).encode()).hexdigest()[:16]


def check_tokenizer(paths: list[str | Path], target) -> None:
    """Refuse tokenized data made by another tokenizer than ``target``'s (a one-line ``BadFileError`` naming the
    folder); folders from before the fingerprint was recorded are checked by vocabulary size only."""
    tokenizer = None
    for path in map(Path, paths):
        manifest = _read_manifest(path)
        size = manifest.get("vocab_size")
        if isinstance(size, int) and size > target.vocab_size:
            raise _bad(path / "manifest.json", f"was made by a tokenizer of {size} tokens, more than the target's "
                       f"vocabulary of {target.vocab_size} (another model's data?)")
        recorded = manifest.get("tokenizer_fingerprint")
        if not recorded:
            continue
        if tokenizer is None:
            from dspark.target.model import load_tokenizer

            tokenizer = target.tokenizer or (load_tokenizer(target.path) if target.path else None)
            if tokenizer is None:
                return
        mine = tokenizer_fingerprint(tokenizer)
        if mine != recorded:
            raise _bad(path / "manifest.json", f"was made by tokenizer {manifest.get('tokenizer')!r} (fingerprint "
                       f"{recorded}), not the target's (fingerprint {mine}): tokenize it again with --target "
                       f"{target.name}")


def _bad(path: Path, what: str) -> BadFileError:
    return BadFileError(f"tokenized data {path} {what}; re-run `dspark data tokenize`")


def _read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.is_file():
        raise BadFileError(f"{folder} is not a tokenized dataset (no manifest.json); "
                           "create it with `dspark data tokenize`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        raise _bad(path, f"is not valid JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise _bad(path, "must hold a JSON object")
    if manifest.get("version") != FORMAT_VERSION:
        raise _bad(path, f"has format version {manifest.get('version')!r}, this dspark reads version {FORMAT_VERSION}")
    for key in ("num_samples", "num_tokens"):
        value = manifest.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _bad(path, f"needs {key!r} as an integer >= 0, got {value!r}")
    return manifest


def _load_array(path: Path, length: int, mmap: bool) -> np.ndarray:  # (length,) integers
    """One of the folder's arrays, checked to be a 1-D integer array of ``length`` entries."""
    if not path.is_file():
        raise _bad(path, "is missing")
    try:
        array = np.load(path, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError) as err:  # truncated, not .npy, or pickled objects
        raise _bad(path, f"is truncated or not a .npy array ({err})") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise _bad(path, f"must be a 1-D integer array, got shape {array.shape} of {array.dtype}")
    if len(array) != length:
        raise _bad(path, f"has {len(array)} entries where {path.with_name('manifest.json')} needs {length}")
    return array


class TokenizedDataset(Dataset):
    """Samples of a `write_tokenized` folder: `{"input_ids": (L,) long, "loss_mask": (L,) long}`.

    The manifest and the arrays are checked on load (counts, offsets, token ids); a bad folder raises
    ``BadFileError`` naming the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        num_samples, num_tokens = self.manifest["num_samples"], self.manifest["num_tokens"]
        offsets_path = self.path / "offsets.npy"
        self.offsets = _load_array(offsets_path, num_samples + 1, mmap=False)  # (N+1,)
        if self.offsets[0] != 0 or self.offsets[-1] != num_tokens or (np.diff(self.offsets) < 0).any():
            raise _bad(offsets_path, f"must rise from 0 to num_tokens = {num_tokens} without decreasing")
        self.lengths = np.diff(self.offsets)  # (N,)
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # memory maps, opened per process
        input_ids, _ = self._maps()
        vocab_size = self.manifest.get("vocab_size")
        vocab_size = vocab_size if isinstance(vocab_size, int) and vocab_size > 0 else np.iinfo(np.int64).max
        if num_tokens and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab_size:
            raise _bad(self.path / "input_ids.npy", f"holds token ids outside [0, vocab_size = {vocab_size})")

    def __getstate__(self) -> dict:  # DataLoader workers reopen the maps instead of copying them
        return {**self.__dict__, "_arrays": None}

    def _maps(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            num_tokens = self.manifest["num_tokens"]
            self._arrays = (_load_array(self.path / "input_ids.npy", num_tokens, mmap=True),  # (T,)
                            _load_array(self.path / "loss_mask.npy", num_tokens, mmap=True))  # (T,)
        return self._arrays

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= idx < len(self):
            raise IndexError(idx)
        idx %= len(self)
        start, end = int(self.offsets[idx]), int(self.offsets[idx + 1])
        input_ids, loss_mask = self._maps()
        return {
            "input_ids": torch.from_numpy(input_ids[start:end].astype(np.int64)),  # (L,)
            "loss_mask": torch.from_numpy(loss_mask[start:end].astype(np.int64)),  # (L,)
        }


def load_tokenized(paths: list[str | Path]) -> Dataset:
    """One dataset over one or more tokenized folders (``dspark data tokenize`` output), in the given order."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise DSparkError(f"training data {missing} not found; build it with `dspark data tokenize` first")
    parts = [TokenizedDataset(p) for p in paths]
    return parts[0] if len(parts) == 1 else torch.utils.data.ConcatDataset(parts)


def pack_batches(dataset: TokenizedDataset | list[int], max_tokens: int, shuffle: bool = True,
                 seed: int = 0) -> list[list[int]]:
    """Index batches of similar length whose padded size (B × longest L) stays within `max_tokens`.

    Samples are sorted by length and cut greedily into batches; a sample longer than `max_tokens`
    gets a batch of its own. With `shuffle`, the batch order (not the contents) is shuffled under
    `seed`. `dataset` may also be a plain list of lengths.
    """
    if max_tokens <= 0:
        raise DSparkError("max_tokens must be positive")
    lengths = np.asarray(dataset.lengths if hasattr(dataset, "lengths") else dataset)
    order = np.argsort(lengths, kind="stable")
    batches: list[list[int]] = []
    current: list[int] = []
    for idx in order.tolist():
        if current and (len(current) + 1) * int(lengths[idx]) > max_tokens:  # sorted: idx is the longest
            batches.append(current)
            current = []
        current.append(idx)
    if current:
        batches.append(current)
    if shuffle:
        random.Random(seed).shuffle(batches)
    return batches


def collate_padded(samples: list[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids (B, L) long, loss_mask (B, L) long, attention_mask (B, L) long."""
    longest = max(len(s["input_ids"]) for s in samples)
    batch = {
        "input_ids": torch.full((len(samples), longest), pad_token_id, dtype=torch.long),  # (B, L)
        "loss_mask": torch.zeros((len(samples), longest), dtype=torch.long),  # (B, L)
        "attention_mask": torch.zeros((len(samples), longest), dtype=torch.long),  # (B, L)
    }
    for row, sample in enumerate(samples):
        length = len(sample["input_ids"])
        batch["input_ids"][row, :length] = sample["input_ids"]
        batch["loss_mask"][row, :length] = sample["loss_mask"]
        batch["attention_mask"][row, :length] = 1
    return batch
