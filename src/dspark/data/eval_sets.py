"""Evaluation prompt sets: the paper's eight benchmarks and any ``{"turns": [...]}`` JSONL.

The eight sets ship with the package in ``dspark/data/eval`` (where they come from: its SOURCES.md);
``--eval-dir DIR`` or ``$DSPARK_EVAL_DIR`` points every command at another folder of the same files.

Protocol (DeepSpec's, docs/interop.md §Evaluation protocol): the first turn of each record is the
prompt (one user message through the chat template); each benchmark is capped
(``EVAL_CAPS``); a set longer than its cap is shuffled with
``random.Random(seed)`` and truncated; sample ``idx`` of the selection is
decoded with seed ``seed + idx``. ``limit`` (CPU-sized runs) cuts the same way:
shuffle, then keep the first ``min(cap, limit)`` rows, so a limited run of a set
over its cap evaluates a prefix of the full run's samples.

Held-out calibration prompts (``heldout_dataset``) are the rows *after* the cap
in that same shuffle: gsm8k (819 rows), livecodebench (555), arena-hard-v2
(250) and mbpp (1), one or more per domain. They never overlap the evaluated
rows for the same seed, whatever ``limit`` either side uses; rows whose text
also occurs among the evaluated rows (duplicate questions) are dropped too.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dspark.errors import DSparkError

DEFAULT_SEED = 980406  # DeepSpec's eval seed

DOMAINS: dict[str, tuple[str, ...]] = {
    "math": ("gsm8k", "math500", "aime25"),
    "code": ("mbpp", "humaneval", "livecodebench"),
    "chat": ("mt-bench", "arena-hard-v2"),
}
BENCHMARKS: tuple[str, ...] = tuple(name for names in DOMAINS.values() for name in names)

# DeepSpec's per-benchmark caps (docs/interop.md §Evaluation protocol, data/eval/SOURCES.md)
EVAL_CAPS: dict[str, int] = {
    "gsm8k": 500, "math500": 500, "aime25": 30,
    "mbpp": 256, "humaneval": 164, "livecodebench": 500,
    "mt-bench": 80, "arena-hard-v2": 500, "alpaca": 500, "alpaca-substitute": 500,
}
# sets that are not in the eval folder but belong to a paper domain when given with --jsonl
EXTRA_DOMAINS: dict[str, str] = {"alpaca": "chat", "alpaca-substitute": "chat"}
CUSTOM_DOMAIN = "custom"

# column titles of the paper's Table 1
DISPLAY_NAMES: dict[str, str] = {
    "gsm8k": "GSM8K", "math500": "MATH500", "aime25": "AIME25", "mbpp": "MBPP", "humaneval": "HumanEval",
    "livecodebench": "LCB", "mt-bench": "MT-Bench", "arena-hard-v2": "Arena-Hard", "alpaca": "Alpaca",
    "alpaca-substitute": "Alpaca (subst.)",
}


class DatasetError(DSparkError):
    """An evaluation set is missing or malformed."""


@dataclass
class EvalSample:
    dataset: str
    idx: int  # position in the selection; the decoding seed is seed + idx
    row: int  # 0-based line of the record in its JSONL (non-empty lines)
    prompt: str | list[int]  # first user turn, or token ids (tests, pre-tokenised prompts)
    seed: int


@dataclass
class EvalDataset:
    name: str
    domain: str
    samples: list[EvalSample] = field(default_factory=list)
    source: str | None = None  # the JSONL path, for the record

    def __len__(self) -> int:
        return len(self.samples)


def domain_of(name: str) -> str:
    """The paper domain of a benchmark name, or ``custom``."""
    for domain, names in DOMAINS.items():
        if name in names:
            return domain
    return EXTRA_DOMAINS.get(name, CUSTOM_DOMAIN)


# --------------------------------------------------------------------------- files


def packaged_eval_dir() -> Path:
    """The eight evaluation sets shipped inside the package (``dspark/data/eval``, see its SOURCES.md)."""
    return Path(str(resources.files("dspark.data").joinpath("eval")))


def find_eval_dir(eval_dir: str | Path | None = None) -> Path:
    """``eval_dir`` (``--eval-dir``), else ``$DSPARK_EVAL_DIR``, else the sets shipped with the package."""
    if eval_dir is not None:
        path = Path(eval_dir).expanduser()
        if not path.is_dir():
            raise DatasetError(f"--eval-dir {path} is not a folder of evaluation JSONL files")
        return path
    if os.environ.get("DSPARK_EVAL_DIR"):
        path = Path(os.environ["DSPARK_EVAL_DIR"]).expanduser()
        if not path.is_dir():
            raise DatasetError(f"DSPARK_EVAL_DIR={path} is not a folder of evaluation JSONL files; "
                               "point it at one, unset it to use the packaged sets, or pass --eval-dir DIR")
        return path
    path = packaged_eval_dir()
    if not path.is_dir() or not any(path.glob("*.jsonl")):
        raise DatasetError(f"the evaluation sets shipped with dspark are missing from {path}; reinstall dspark, "
                           "or pass --eval-dir DIR (or set DSPARK_EVAL_DIR) to a folder with gsm8k.jsonl, ...")
    return path


def read_first_turns(path: str | Path) -> list[str]:
    """First turn of every ``{"turns": [...]}`` record (blank lines skipped)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"{path} does not exist; give a JSONL file with one {{\"turns\": [...]}} per line")
    turns: list[str] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{lineno} is not valid JSON ({err})") from None
            first = record.get("turns") if isinstance(record, dict) else None
            if not isinstance(first, list) or not first or not isinstance(first[0], str) or not first[0].strip():
                raise DatasetError(f"{path}:{lineno} needs a non-empty \"turns\" list whose first item is a string")
            turns.append(first[0])
    if not turns:
        raise DatasetError(f"{path} has no records")
    return turns


def _order(num_rows: int, keep: int, seed: int) -> list[int]:
    """Row order of a selection: file order if everything fits, else shuffled with Random(seed)."""
    rows = list(range(num_rows))
    if num_rows > keep:
        random.Random(seed).shuffle(rows)
    return rows


def select_rows(num_rows: int, cap: int | None, limit: int | None, seed: int) -> list[int]:
    """Rows evaluated (in order): shuffle + truncate when over min(cap, limit), DeepSpec's rule."""
    keep = min(x for x in (cap, limit, num_rows) if x is not None)
    if keep < 0:
        raise DatasetError(f"limit must be >= 0, got {limit}")
    return _order(num_rows, keep, seed)[:keep]


def _build(name: str, domain: str, turns: list[str], rows: list[int], seed: int, source: Path) -> EvalDataset:
    samples = [EvalSample(name, idx, row, turns[row], seed + idx) for idx, row in enumerate(rows)]
    return EvalDataset(name, domain, samples, str(source))


def load_jsonl_dataset(
    path: str | Path, name: str | None = None, domain: str | None = None,
    limit: int | None = None, seed: int = DEFAULT_SEED, cap: int | None = None,
) -> EvalDataset:
    """Any ``{"turns": [...]}`` JSONL; ``name`` defaults to the file stem, ``cap`` to its EVAL_CAPS entry."""
    path = Path(path).expanduser()
    name = name or path.stem
    turns = read_first_turns(path)
    cap = EVAL_CAPS.get(name) if cap is None else cap
    return _build(name, domain or domain_of(name), turns, select_rows(len(turns), cap, limit, seed), seed, path)


def load_eval_dataset(
    name: str, eval_dir: str | Path | None = None, limit: int | None = None, seed: int = DEFAULT_SEED,
) -> EvalDataset:
    """One of the eight benchmarks in the eval folder, capped and shuffled like DeepSpec."""
    if name not in BENCHMARKS:
        raise DatasetError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)} or pass --jsonl FILE")
    folder = find_eval_dir(eval_dir)
    path = folder / f"{name}.jsonl"
    if not path.is_file():
        raise DatasetError(f"{path} is missing; the eval folder {folder} must hold {name}.jsonl")
    return load_jsonl_dataset(path, name, domain_of(name), limit, seed, EVAL_CAPS[name])


def parse_dataset_names(text: str) -> list[str]:
    """``"gsm8k,mt-bench"``; ``all`` = the eight benchmarks; a domain name = its benchmarks."""
    names: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == "all":
            names += BENCHMARKS
        elif item in DOMAINS:
            names += DOMAINS[item]
        elif item in BENCHMARKS:
            names.append(item)
        else:
            raise DatasetError(
                f"unknown dataset {item!r}; choose from all, {', '.join(DOMAINS)}, {', '.join(BENCHMARKS)} "
                "or pass --jsonl FILE"
            )
    return list(dict.fromkeys(names))


def heldout_dataset(
    name: str, eval_dir: str | Path | None = None, limit: int | None = None, seed: int = DEFAULT_SEED,
) -> EvalDataset:
    """Calibration prompts: the rows of ``name`` after its evaluation cap (see the module docstring).

    ``idx`` continues after the cap, so decoding seeds never repeat an evaluated sample's.
    """
    if name not in BENCHMARKS:
        raise DatasetError(f"unknown benchmark {name!r}; choose from {', '.join(heldout_names(eval_dir))}")
    folder = find_eval_dir(eval_dir)
    path = folder / f"{name}.jsonl"
    turns = read_first_turns(path)
    cap = EVAL_CAPS[name]
    if len(turns) <= cap:
        raise DatasetError(
            f"{name} has {len(turns)} rows, all used for evaluation (cap {cap}); no held-out rows. "
            f"Use {', '.join(heldout_names(eval_dir)) or 'a set over its cap'} or pass --jsonl FILE"
        )
    order = _order(len(turns), cap, seed)
    evaluated = {turns[r].strip() for r in order[:cap]}
    rest = [(cap + i, r) for i, r in enumerate(order[cap:]) if turns[r].strip() not in evaluated]
    if limit is not None:
        rest = rest[:limit]
    samples = [EvalSample(name, idx, row, turns[row], seed + idx) for idx, row in rest]
    return EvalDataset(name, domain_of(name), samples, str(path))


def heldout_names(eval_dir: str | Path | None = None) -> list[str]:
    """Benchmarks with rows beyond their cap in the eval folder."""
    folder = find_eval_dir(eval_dir)
    names = []
    for name in BENCHMARKS:
        path = folder / f"{name}.jsonl"
        if path.is_file() and sum(1 for line in path.open(encoding="utf-8") if line.strip()) > EVAL_CAPS[name]:
            names.append(name)
    return names


def token_dataset(name: str, prompts: list[list[int]], domain: str | None = None,
                  seed: int = DEFAULT_SEED) -> EvalDataset:
    """A dataset of pre-tokenised prompts (targets without a tokenizer, tests)."""
    samples = [EvalSample(name, i, i, list(p), seed + i) for i, p in enumerate(prompts)]
    return EvalDataset(name, domain or domain_of(name), samples, None)
