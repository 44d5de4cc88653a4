"""Teacher-forced labelling data (`dspark data label`): existing (prompt, answer) text from the offline
sources, for the target to label in one prefill instead of answering by decoding.

The answers are real text that ships with Python packages or the interpreter, not the target's: the
feature build (`dspark data features`) gives the target's distribution at every position of them, and
tokenize marks their reply tokens with loss-mask value 2, so the CE label there is the target's argmax
(docs/training.md §Teacher-forced labelling).

| domain | source       | prompt                                                  | answer                          |
|--------|--------------|---------------------------------------------------------|---------------------------------|
| math   | gsm_symbolic | the GSM-Symbolic question, with the math suffix         | its worked solution, \\boxed{}  |
| code   | codeio       | "Write a Python function `main_solution` ..." + task    | the task's reference code       |
| code   | stdlib       | "Implement `name` from Python's `module` module" + doc  | the function's source           |
| chat   | chatterbot   | a chatterbot-corpus statement                           | its response, turn by turn      |
| chat   | pydoc_topics | "Explain <language reference section title>"            | the section's text              |
| chat   | stdlib_docs  | "Explain what `qualified.name` ... does"                | its docstring                   |
| chat   | python_docs  | "Explain <page title>" (Debian python3.X-doc)           | the page's leading prose        |

Other reasoning-gym math generators give bare answers (a number), not worked ones, so they are not
used; nor is the OpenAI `evals` data (not installed here, its answers not checked). GSM-Symbolic's solutions were written from
GSM8K *test* questions like its templates (see `dspark.data.prompt_sources`): set its weight to 0
(and the math share to 0) for a template-disjoint build.

Disjointness: every item goes through the prompt filter of `dspark.data.decontaminate` under the
same source key as in `dspark data prompts` (so items reserved for the evaluation substitute never
appear, and prompts matching an evaluation first turn are dropped), and its answer must not match or
overlap an evaluation first turn either. Documentation answers leave out the paragraphs reserved for
the substitute.

Output record (one JSON object per line), the regenerated-record shape:
`{"id", "domain", "source", "conversations": [{"role": "user", ...}, {"role": "assistant", ...}, ...],
"status": "success", "label": "teacher_forced"}`.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dspark.data.chat import TEACHER_FORCED
from dspark.data.decontaminate import EvalIndex, PromptFilter, is_reserved, normalise
from dspark.data.eval_sets import find_eval_dir
from dspark.data.prompt_sources import (
    CODEIO_TEMPLATES,
    DATA_EXTRA_HINT,
    DOMAINS,
    as_math_prompt,
    chatterbot_dialogues,
    codeio_tasks,
    default_python_doc_dir,
    doc_blocks,
    doc_paragraphs,
    import_reasoning_gym,
    rg_items,
    round_robin_files,
    stdlib_docstrings,
    stdlib_functions,
)
from dspark.data.prompts import PromptSetSummary, domain_counts, draw_by_weight, parse_mix, record_id, write_jsonl
from dspark.errors import DSparkError

DEFAULT_MAX_ANSWER_CHARS = 6000

Pair = tuple[str, list[dict]]  # (source item key, conversation: user and assistant turns, assistant last)


@dataclass(frozen=True)
class LabelSource:
    """A named stream of (key, conversation) pairs with existing answers, for one domain.

    `pairs(rng, max_answer_chars)` yields them in an order fixed by `rng`; `key` names the source
    item as the prompt source of the same name does (for the split reservation). No answer is
    longer than `max_answer_chars`: documentation is cut at a paragraph boundary, other answers
    that do not fit are skipped."""

    name: str
    domain: str
    weight: float
    pairs: Callable[[random.Random, int], Iterator[Pair]]


def _turns(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _code_block(src: str) -> str:
    return f"```python\n{src.strip()}\n```"


_FINAL_LINE = re.compile(r"\n#### *(.+?)\s*$")


def _gsm_symbolic(rng: random.Random, max_chars: int) -> Iterator[Pair]:
    rg = import_reasoning_gym()
    for item in rg_items(rg, "gsm_symbolic", rng.randrange(2**31)):
        cot = (item.get("metadata") or {}).get("answer_cot")
        if not isinstance(cot, str) or not _FINAL_LINE.search(cot):
            continue
        # GSM8K's "#### 42" becomes the \boxed{} the math prompt asks for
        answer = _FINAL_LINE.sub(lambda m: f"\n\nThe final answer is \\boxed{{{m.group(1)}}}.", cot.strip())
        if len(answer) <= max_chars:
            yield item["question"], _turns(as_math_prompt(item["question"]), answer)


def _codeio(rng: random.Random, max_chars: int) -> Iterator[Pair]:
    tasks = codeio_tasks()
    order = list(range(len(tasks)))
    rng.shuffle(order)
    for i in order:
        task = tasks[i]
        prompt = CODEIO_TEMPLATES[0].format(task=task["task_description"].strip(),
                                             spec=task["input_output_spec"].strip())
        answer = _code_block(task["code_sample"])
        if len(answer) <= max_chars:
            yield f"codeio:{i}", _turns(prompt, answer)


def _stdlib_prompt(module: str, qualname: str, src: str) -> str | None:
    try:
        node = ast.parse(src).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    doc = ast.get_docstring(node)
    head = f"Implement `{qualname}` from Python's `{module}` module"
    if doc:
        return f"{head}. Its documentation says:\n\n{doc}"
    return f"{head}, with the signature `{node.name}({ast.unparse(node.args)})`."


def _stdlib(rng: random.Random, max_chars: int) -> Iterator[Pair]:
    for module, (qualname, src, _) in round_robin_files(rng, stdlib_functions):
        prompt = _stdlib_prompt(module, qualname, src)
        answer = _code_block(src)
        if prompt is not None and len(answer) <= max_chars:
            yield f"stdlib:{module}:{qualname}", _turns(prompt, answer)


def _chatterbot(rng: random.Random, max_chars: int) -> Iterator[Pair]:
    dialogues = list(chatterbot_dialogues().items())
    rng.shuffle(dialogues)
    for first, dialogue in dialogues:
        lines = [t.strip() for t in dialogue if isinstance(t, str)]
        if len(lines) != len(dialogue) or len(lines) < 2 or not all(lines):
            continue
        lines = lines[: len(lines) // 2 * 2]  # statement -> response pairs; the last turn is a response
        if max(len(t) for t in lines[1::2]) <= max_chars:
            roles = ("user", "assistant") * (len(lines) // 2)
            yield f"chatterbot:{first}", [{"role": r, "content": t} for r, t in zip(roles, lines)]


def _fit(parts: list[str], max_chars: int) -> str:
    """The leading parts joined by blank lines, as many as fit in max_chars ("" if none does)."""
    out, used = [], 0
    for part in parts:
        used += len(part) + 2 * bool(out)
        if used > max_chars:
            break
        out.append(part)
    return "\n\n".join(out)


def _pydoc_topics(rng: random.Random, max_chars: int) -> Iterator[Pair]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    rng.shuffle(names)
    for name in names:
        title = topics[name].strip().split("\n", 1)[0].strip()
        parts, i = [], 0
        # the blocks of the whole text, so that paragraph i is the prompt source's paragraph i
        for j, (block, prose) in enumerate(doc_blocks(topics[name], min_words=25)):
            if prose is not None:
                i += 1
                if is_reserved(f"pydoc:{name}:{i - 1}"):  # kept for the evaluation substitute
                    continue
            if block.strip() and not (j == 0 and block.strip().startswith(title)):  # not the heading
                parts.append(block.strip("\n"))
        answer = _fit(parts, max_chars)
        if answer:
            yield f"pydoc:{name}", _turns(f"Explain {title} in Python, as the language reference does.", answer)


def _stdlib_docs(rng: random.Random, max_chars: int) -> Iterator[Pair]:
    for module, (qualname, doc) in round_robin_files(rng, stdlib_docstrings):
        what = f"the Python module `{module}` is for" if qualname == module else \
            f"`{qualname}` in Python's standard library does"
        if len(doc) <= max_chars:
            yield f"stdlib_docs:{qualname}", _turns(f"Explain what {what}.", doc)


_REST_TITLE = re.compile(r"^(?:[=*#-]{3,}\n)?(\S[^\n]*)\n[=*#-]{3,}$", re.MULTILINE)


def _python_docs(doc_dir: Path | None) -> Callable[[random.Random, int], Iterator[Pair]]:
    def pairs(rng: random.Random, max_chars: int) -> Iterator[Pair]:
        if doc_dir is None or not doc_dir.is_dir():
            return
        paths = [p for p in sorted(doc_dir.rglob("*.txt")) if p.relative_to(doc_dir).parts[0] != "whatsnew"]
        rng.shuffle(paths)
        for path in paths:
            text = path.read_text(encoding="utf-8", errors="replace")
            title = _REST_TITLE.search(text)
            rel = path.relative_to(doc_dir).as_posix()
            # paragraph i has the key the prompt source gives it; reserved ones stay out
            kept = [p for i, p in enumerate(doc_paragraphs(text)) if not is_reserved(f"python_docs:{rel}:{i}")]
            answer = _fit(kept, max_chars)
            if title and answer:
                name = re.sub(r"[`*]|:\w+:", "", title.group(1)).strip()
                yield f"python_docs:{rel}", _turns(f"Explain {name} (from the Python documentation).", answer)

    return pairs


DEFAULT_WEIGHTS = {
    "gsm_symbolic": 1.0,
    "codeio": 1.0, "stdlib": 1.0,
    "chatterbot": 0.5, "pydoc_topics": 0.5, "stdlib_docs": 1.0, "python_docs": 1.0,
}


def default_label_sources(python_doc_dir: Path | None = None,
                          weights: dict[str, float] | None = None) -> list[LabelSource]:
    """All built-in label sources; those whose data is absent yield nothing. `weights` overrides
    `DEFAULT_WEIGHTS` by source name; a weight of 0 disables a source."""
    weights = {**DEFAULT_WEIGHTS, **(weights or {})}
    unknown = set(weights) - set(DEFAULT_WEIGHTS)
    if unknown:
        raise DSparkError(f"unknown label source(s) {sorted(unknown)}; known: {sorted(DEFAULT_WEIGHTS)}")
    if any(w < 0 for w in weights.values()):
        raise DSparkError(f"source weights must be >= 0, got {weights}")
    streams = {
        "gsm_symbolic": ("math", _gsm_symbolic), "codeio": ("code", _codeio), "stdlib": ("code", _stdlib),
        "chatterbot": ("chat", _chatterbot), "pydoc_topics": ("chat", _pydoc_topics),
        "stdlib_docs": ("chat", _stdlib_docs),
        "python_docs": ("chat", _python_docs(python_doc_dir or default_python_doc_dir())),
    }
    return [LabelSource(name, domain, weights[name], fn)
            for name, (domain, fn) in streams.items() if weights[name] > 0]


@dataclass
class AnswerFilter:
    """The prompt filter on the first user turn, then no evaluation match or overlap in the other turns."""

    prompts: PromptFilter

    def accept(self, key: str, conversation: list[dict]) -> bool:
        if not self.prompts.accept(key, conversation[0]["content"]):
            return False
        index, limit = self.prompts.eval_index, self.prompts.max_eval_overlap
        rest = normalise("\n".join(m["content"] for m in conversation[1:]))
        if index.matches(rest) or (limit is not None and index.overlap(rest) > limit):
            self.prompts.dropped["answer_eval_match"] += 1
            return False
        return True


def draw_pairs(sources: list[LabelSource], count: int, rng: random.Random, seed: int, keep: AnswerFilter,
               max_answer_chars: int, progress=None) -> list[tuple[LabelSource, list[dict]]]:
    """Up to `count` accepted conversations, drawing from the sources by weight until they run dry."""
    streams = {s.name: iter(s.pairs(random.Random(f"{seed}:{s.name}"), max_answer_chars)) for s in sources}
    return draw_by_weight(sources, streams, count, rng, keep.accept, progress)


@dataclass
class LabelSetSummary(PromptSetSummary):
    answer_chars: int = 0  # characters of the answers the target will label

    def __str__(self) -> str:
        return (f"wrote {sum(self.written.values())} teacher-forced records ({self.answer_chars} answer characters) "
                f"to {self.path}: domains {self.written} (requested {self.requested}), sources {self.by_source}, "
                f"dropped {self.dropped}")


def build_label_set(out_path: str | Path, num_records: int, mix: str | dict[str, float] | None = None,
                    seed: int = 0, eval_dir: str | Path | None = None, *, sources: list[LabelSource] | None = None,
                    max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS, max_eval_overlap: float | None = 0.5,
                    allow_short: bool = False, progress: bool = True) -> LabelSetSummary:
    """Write `num_records` (prompt, existing answer) conversations, mixed by domain, as JSONL (see the
    module docstring). Deterministic for a seed, source data and Python version; written atomically."""
    from tqdm.auto import tqdm

    if num_records <= 0:
        raise DSparkError(f"--num must be positive, got {num_records}")
    if max_answer_chars <= 0:
        raise DSparkError(f"--max-answer-chars must be positive, got {max_answer_chars}")
    counts = domain_counts(num_records, parse_mix(mix))
    keep = AnswerFilter(PromptFilter(EvalIndex.from_dir(find_eval_dir(eval_dir)), keep_reserved=False,
                                     max_eval_overlap=max_eval_overlap))
    sources = default_label_sources() if sources is None else sources
    chosen: list[tuple[LabelSource, list[dict]]] = []
    with tqdm(total=num_records, desc="label", unit="record", disable=not progress) as bar:
        for domain in DOMAINS:
            if counts[domain] == 0:
                continue
            domain_sources = [s for s in sources if s.domain == domain]
            got = draw_pairs(domain_sources, counts[domain], random.Random(f"{seed}:{domain}"), seed, keep,
                             max_answer_chars, bar)
            if len(got) < counts[domain] and not allow_short:
                names = ", ".join(s.name for s in domain_sources) or "none"
                raise DSparkError(
                    f"only {len(got)} of {counts[domain]} {domain} records are available offline (sources: "
                    f"{names}). Lower --num, change --mix or --weights, raise --max-answer-chars, add data "
                    f"({DATA_EXTRA_HINT}; python3.11-doc for python_docs), or pass --allow-short")
            chosen += got
    random.Random(seed).shuffle(chosen)
    records = [{"id": record_id(s.name, "\x00".join(m["content"] for m in conv)), "domain": s.domain,
                "source": s.name, "conversations": conv, "status": "success", "label": TEACHER_FORCED}
               for s, conv in chosen]
    out_path = Path(out_path)
    write_jsonl(out_path, records)
    return LabelSetSummary(
        path=out_path, requested=counts, written=dict(Counter(s.domain for s, _ in chosen)),
        by_source=dict(Counter(s.name for s, _ in chosen)),
        answer_chars=sum(len(m["content"]) for _, conv in chosen for m in conv if m["role"] == "assistant"),
        dropped=dict(keep.prompts.dropped))
