"""Optional dependencies: the pyproject extras a command needs beyond the core install.

The core install carries what every command needs; figures (matplotlib), TensorBoard logs and the GGUF
conversion of a preset target (gguf) come with extras. ``require`` imports one when a command first needs
it and, when it is missing, raises a one-line error that names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from dspark.errors import DSparkError

#: extra name -> what it installs (pyproject.toml [project.optional-dependencies]; `all` is every one)
EXTRAS = {
    "plots": "matplotlib (the PNG figures of eval, calibrate, bench serve, simulate, reproduce)",
    "tensorboard": "tensorboard (TensorBoard logs of dspark train; metrics.jsonl is always written)",
    "gguf": "gguf and accelerate (dspark prepare: converting a GGUF preset such as smollm2-135m)",
}


class MissingExtraError(DSparkError, ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def install_hint(extra: str) -> str:
    return f"pip install 'dspark[{extra}]'"


def require(module: str, extra: str, what: str) -> ModuleType:
    """``import module``, or a ``MissingExtraError`` saying that ``what`` needs ``dspark[extra]``."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise MissingExtraError(f"{what} needs {package}, which the core install leaves out: "
                                f"{install_hint(extra)}") from None
