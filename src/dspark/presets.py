"""Training-config presets: the JSON files bundled in ``dspark/configs`` or a user's JSON file, and ``--set``.

Read by ``dspark train`` (``training.config`` turns the dict into a ``TrainConfig``) and by
``dspark data features --config`` (which needs only the target, data and layer fields).
Keys starting with ``_`` are comments and are dropped.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from dspark.errors import DSparkError


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files("dspark").joinpath("configs").iterdir()
                  if p.name.endswith(".json"))


def read_preset(name_or_path: str, error: type[DSparkError] = DSparkError) -> dict[str, Any]:
    """The config a JSON file or a bundled preset holds; ``error`` is raised for a missing or malformed one."""
    path = Path(name_or_path).expanduser()
    source = path
    if not path.is_file():
        source = resources.files("dspark").joinpath("configs", f"{name_or_path.removesuffix('.json')}.json")
        if not source.is_file():
            raise error(f"--config {name_or_path!r}: no such file and no such preset; presets: {', '.join(preset_names())}")
        path = Path(str(source))
    try:
        raw = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        raise error(f"config {path} is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise error(f"config {path} must hold a JSON object of training config fields")
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def parse_value(text: str) -> Any:
    """JSON if it parses (numbers, true/false/null, lists, objects), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str], error: type[DSparkError] = DSparkError) -> dict[str, Any]:
    """Apply ``key=value`` strings; ``model.x=v`` sets a model sub-config field. Returns a new dict."""
    raw = json.loads(json.dumps(raw))  # deep copy
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise error(f"--set {item!r}: expected key=value (e.g. lr=3e-4 or model.block_size=7)")
        head, _, rest = key.partition(".")
        if rest:
            if head != "model":
                raise error(f"--set {item!r}: only model.<field> may be dotted")
            raw.setdefault("model", {})[rest] = parse_value(value)
        else:
            raw[key] = parse_value(value)
    return raw
