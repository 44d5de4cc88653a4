"""Training samples: index -> ``TrainSample``, from a feature cache or a tokenized dataset plus the target.

Shapes: L = sequence length, H = target hidden size, F = target-feature width.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from dspark.data import features
from dspark.data.tokenized import load_tokenized
from dspark.drafters.sample import TrainSample
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


def load_token_dataset(paths: list[str]):
    """The tokenized training data (``dspark data tokenize`` output)."""
    if not paths:
        raise TrainConfigError("training config: data is empty; give the tokenized dataset path(s)")
    return load_tokenized(paths)


def build_sample_source(cfg: TrainConfig, target, layer_ids: list[int], dtype: torch.dtype,
                        dataset=None) -> SampleSource:
    if cfg.feature_source == "cache":
        if dataset is None:
            if not cfg.cache_dir:
                raise TrainConfigError("feature_source is 'cache' but cache_dir is not set")
            dataset = features.FeatureCacheDataset(cfg.cache_dir, dtype=dtype, max_length=cfg.max_length)
            if layer_ids:
                features.check_cache_fits(dataset.manifest, layer_ids, target.hidden_size)
            else:  # a drafter that reads only the final hidden state can use any cache of this target
                features.check_cache_fits(dataset.manifest, dataset.manifest["target_layer_ids"], target.hidden_size)
        size = len(dataset)
        get = dataset.__getitem__ if layer_ids else (lambda i: _without_features(dataset[i]))
    else:
        dataset = dataset if dataset is not None else load_token_dataset(cfg.data)
        size = len(dataset)

        def get(i: int) -> TrainSample:
            item = dataset[i]
            if isinstance(item, TrainSample):
                return item if layer_ids else _without_features(item)
            if not layer_ids:
                return _last_hidden_sample(target, item, cfg.max_length, dtype)
            return features.online_sample(target, item, layer_ids, cfg.max_length, dtype)
    if cfg.max_samples is not None:
        size = min(size, cfg.max_samples)
    return SampleSource(get, size)


def _without_features(s: TrainSample) -> TrainSample:
    """The sample with an empty (L, 0) feature tensor, for drafters that read no target layers."""
    return TrainSample(s.input_ids, s.loss_mask, s.target_features[:, :0], s.target_last_hidden)


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
    )
