"""DSpark: lossless speculative decoding with semi-autoregressive drafters.

The Python API (``dspark.api``, docs/guide/python-api.md)::

    import dspark
    sd = dspark.load("smollm2-135m", drafter="checkpoints/smollm2-135m-dspark")   # a preset or an HF folder
    out = sd.chat("Write a prime sieve in Python.", max_new_tokens=128)          # or sd.generate(prompts, ...)
    print(out.text, out.acceptance_length)

``load``, ``train``, ``SpeculativeDecoder``, ``Completion``, ``TrainConfig``, ``SamplingParams`` and ``Engine`` are
imported on first use, so ``import dspark`` stays cheap (no torch). Folder layout follows the architecture:
``target`` (the frozen model being accelerated), ``modeling`` (decoder building blocks shared by target and
drafters), ``sampling`` (logit processing and the rejection sampler), ``drafters``, ``generation`` (the
speculative loop), ``training``, ``evaluation``, ``scheduler`` (SPS table and verify-length policies),
``serving`` (engine and HTTP server).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (imported by __getattr__ on first use)
_LAZY = {
    "load": "dspark.api",
    "train": "dspark.api",
    "SpeculativeDecoder": "dspark.api",
    "Completion": "dspark.api",
    "TextStream": "dspark.api",
    "TrainConfig": "dspark.training.config",
    "SamplingParams": "dspark.sampling.processing",
    "Engine": "dspark.serving.engine",
    "EngineConfig": "dspark.serving.engine",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from dspark.api import Completion, SpeculativeDecoder, TextStream, load, train
    from dspark.sampling.processing import SamplingParams
    from dspark.serving.engine import Engine, EngineConfig
    from dspark.training.config import TrainConfig


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
