"""Training samples: index -> ``TrainSample``, from a feature cache or a tokenized dataset plus the target.

``feature_source`` "auto" (the default) builds the feature cache on the first pass when it fits on
disk (half the free space at most) and reads it from then on: the frozen target runs once per
sequence, not once per epoch; otherwise it runs online. With ``logsumexp`` (a drafter with a draft
vocabulary) every sample carries the target's log-normaliser over its full vocabulary.

Shapes: L = sequence length, H = target hidden size, F = target-feature width.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dspark.data import features
from dspark.data.tokenized import check_tokenizer, load_tokenized
from dspark.drafters.sample import TrainSample, target_logsumexp
from dspark.errors import DSparkError
from dspark.training.config import TrainConfig, TrainConfigError


class SampleSource:
    """Index -> TrainSample, from a feature cache or a tokenized dataset plus the target."""

    def __init__(self, get: Callable[[int], TrainSample], size: int) -> None:
        self._get = get
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> TrainSample:
        return self._get(index)


def load_token_dataset(paths: list[str], target=None):
    """The tokenized training data (``dspark data tokenize`` output); with ``target``, checked to come from its
    tokenizer."""
    if not paths:
        raise TrainConfigError("training config: data is empty; give the tokenized dataset path(s)")
    if target is not None:
        check_tokenizer(paths, target)
    return load_tokenized(paths)


def auto_cache_dir(cfg: TrainConfig) -> Path:
    """Where ``feature_source`` "auto" keeps its cache: ``cache_dir``, else OUT/feature-cache."""
    return Path(cfg.cache_dir) if cfg.cache_dir else Path(cfg.out) / "feature-cache"


def cache_folders(folder: str | list[str]) -> list[str]:
    return [folder] if isinstance(folder, (str, Path)) else list(folder)


def open_feature_caches(folder: str | list[str], dtype: torch.dtype, max_length: int | None):
    """One ``FeatureCacheDataset``, or several read as one (``cache_dir`` a list): samples in list order."""
    from torch.utils.data import ConcatDataset

    caches = [features.FeatureCacheDataset(f, dtype=dtype, max_length=max_length) for f in cache_folders(folder)]
    return caches[0] if len(caches) == 1 else ConcatDataset(caches)


def prepare_feature_cache(cfg: TrainConfig, target, layer_ids: list[int], is_main: bool = True
                          ) -> str | list[str] | None:
    """``feature_source`` "auto": the cache folder to read (built now if needed and it fits), or None = online.
    Several folders (``cache_dir`` a list) are never built here: each must hold a finished cache."""
    if isinstance(cfg.cache_dir, list):
        missing = [f for f in cfg.cache_dir if not (Path(f) / "manifest.json").is_file()]
        if missing:
            raise TrainConfigError(f"cache_dir lists {', '.join(missing)}, which hold no finished feature cache "
                                   "(build each with `dspark data features`)")
        return list(cfg.cache_dir)
    folder = auto_cache_dir(cfg)
    if (folder / "manifest.json").is_file():
        return str(folder)
    if not layer_ids:  # the draft LM reads only the final hidden state: online is as cheap
        return None
    data = load_token_dataset(cfg.data, target)
    n = len(data) if cfg.max_samples is None else min(len(data), cfg.max_samples)
    lengths = features.sequence_lengths(data, cfg.max_length)[:n]
    need = int(lengths.sum()) * features.bytes_per_token(
        target.hidden_size, len(layer_ids), logsumexp=True)
    probe = folder if folder.exists() else next(p for p in [folder, *folder.parents] if p.exists())
    free = shutil.disk_usage(probe).free
    if need > free // 2:
        if is_main:
            print(f"[dspark] feature cache of {need / 2**30:.1f} GiB does not fit in half the {free / 2**30:.1f} GiB "
                  f"free at {probe}: target features are computed online", flush=True)
        return None
    if is_main:
        print(f"[dspark] building the feature cache {folder} ({need / 2**30:.2f} GiB, {n} sequences); "
              "later epochs and runs read it", flush=True)
        subset = _Prefix(data, n)
        features.build_feature_cache(target, subset, layer_ids, folder, max_length=cfg.max_length,
                                     source_paths=list(cfg.data))
    return str(folder)


class _Prefix:
    """The first ``n`` items of a dataset."""

    def __init__(self, data, n: int) -> None:
        self.data, self.n = data, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.data[i]


def build_sample_source(cfg: TrainConfig, target, layer_ids: list[int], dtype: torch.dtype,
                        dataset=None, logsumexp: bool = False, cache_dir: str | list[str] | None = None
                        ) -> SampleSource:
    """Index -> TrainSample as ``cfg.feature_source`` says (``cache_dir``: the folder "auto" resolved, None =
    online); with ``logsumexp`` every sample carries ``target_logsumexp``."""
    source = cfg.feature_source
    if source == "auto":
        source = "cache" if cache_dir is not None or (dataset is not None and cfg.cache_dir) else "online"
    if source == "cache":
        if dataset is None:
            folder = cache_dir or cfg.cache_dir
            if not folder:
                raise TrainConfigError("feature_source is 'cache' but cache_dir is not set")
            dataset = open_feature_caches(folder, dtype, cfg.max_length)
            for cache in getattr(dataset, "datasets", [dataset]):
                # a drafter that reads only the final hidden state can use any cache of this target
                ids = layer_ids or cache.manifest["target_layer_ids"]
                features.check_cache_fits(cache.manifest, ids, target.hidden_size, target, cache.cache_dir)
                if layer_ids:
                    cache.select_layers(list(layer_ids))
        size = len(dataset)
        read = dataset.__getitem__ if layer_ids else (lambda i: _without_features(dataset[i]))
        get = read if not logsumexp else (lambda i: with_logsumexp(target, read(i)))
    else:
        dataset = dataset if dataset is not None else load_token_dataset(cfg.data, target)
        size = len(dataset)

        def get(i: int) -> TrainSample:
            item = dataset[i]
            if isinstance(item, TrainSample):
                item = item if layer_ids else _without_features(item)
                return with_logsumexp(target, item) if logsumexp else item
            if not layer_ids:
                return _last_hidden_sample(target, item, cfg.max_length, dtype)
            return features.online_sample(target, item, layer_ids, cfg.max_length, dtype, logsumexp)
    if cfg.max_samples is not None:
        size = min(size, cfg.max_samples)
    return SampleSource(get, size)


def _without_features(s: TrainSample) -> TrainSample:
    """The sample with an empty (L, 0) feature tensor, for drafters that read no target layers."""
    return TrainSample(s.input_ids, s.loss_mask, s.target_features[:, :0], s.target_last_hidden, s.target_logsumexp)


def with_logsumexp(target, s: TrainSample) -> TrainSample:
    """``s`` with ``target_logsumexp`` (computed from its last hidden state when it has none: DeepSpec's caches)."""
    if s.target_logsumexp is not None:
        return s
    return TrainSample(s.input_ids, s.loss_mask, s.target_features, s.target_last_hidden,
                       target_logsumexp(target, s.target_last_hidden))


def _last_hidden_sample(target, item: dict[str, Any], max_length: int | None, dtype: torch.dtype) -> TrainSample:
    """A sample with only the target's final hidden state (the draft LM distils from it)."""
    input_ids = torch.as_tensor(np.asarray(item["input_ids"]), dtype=torch.long)[:max_length]  # (L,)
    loss_mask = torch.as_tensor(np.asarray(item["loss_mask"]), dtype=torch.long)[:max_length]  # (L,)
    if input_ids.numel() > target.max_context:
        raise DSparkError(
            f"a training sequence has {input_ids.numel()} tokens but the target's context is "
            f"{target.max_context}; lower max_length"
        )
    out = target.forward(input_ids, [input_ids.numel()], caches=None, logits_for="none")
    last_hidden = out.last_hidden.clone().to(dtype)  # (L, H); clone: out of inference mode
    return TrainSample(input_ids, loss_mask, last_hidden[:, :0], last_hidden)


def to_device(s: TrainSample, device: torch.device, dtype: torch.dtype) -> TrainSample:
    return TrainSample(
        input_ids=s.input_ids.to(device), loss_mask=s.loss_mask.to(device),
        target_features=s.target_features.to(device, dtype),
        target_last_hidden=s.target_last_hidden.to(device, dtype),
        target_logsumexp=None if s.target_logsumexp is None else s.target_logsumexp.to(device),
    )


def draft_vocab_ids(cfg: TrainConfig, target, cache_dir: str | None = None) -> list[int] | None:
    """The draft vocabulary a DSpark/DFlash/Eagle3 run trains with: ``draft_vocab_file``, or the ``draft_vocab_size``
    most frequent answer tokens of the training data (saved to OUT/draft-vocab.json), or None = all V."""
    from dspark.data.vocab import build_draft_vocab, count_sequences
    from dspark.drafters.draft_vocab import load_draft_vocab, save_draft_vocab

    if cfg.draft_vocab_file:
        return load_draft_vocab(cfg.draft_vocab_file, target.vocab_size)
    if not cfg.draft_vocab_size:
        return None
    if cfg.draft_vocab_size >= target.vocab_size:
        return None
    folder = None if cfg.data else (cache_dir or cfg.cache_dir)  # count the tokenized data when there is some
    data = open_feature_caches(folder, torch.float32, None) if folder else load_token_dataset(cfg.data, target)
    n = len(data) if cfg.max_samples is None else min(len(data), cfg.max_samples)
    counts = count_sequences((_tokens(data[i]) for i in range(n)), target.vocab_size, str(folder or cfg.data))
    ids, coverage = build_draft_vocab(counts, cfg.draft_vocab_size, sorted(target.eos_token_ids))
    save_draft_vocab(Path(cfg.out) / "draft-vocab.json", ids, target.vocab_size, coverage, str(folder or cfg.data))
    return ids


def _tokens(item) -> tuple[Any, Any]:  # a TrainSample or a tokenized item -> (input_ids, loss_mask)
    if isinstance(item, TrainSample):
        return item.input_ids, item.loss_mask
    return item["input_ids"], item["loss_mask"]
