import json
import random
from collections import Counter

import pytest

from dspark.data.decontaminate import EvalIndex, is_reserved, normalise
from dspark.data.prompt_sources import MATH_SUFFIX, PromptSource, default_sources
from dspark.data.prompts import build_prompt_set, parse_mix
from dspark.data.substitute import substitute_alpaca
from dspark.errors import DSparkError

EVAL_TURN = "Janet has 16 ducks that lay eggs every single day of the week. How many eggs does she collect?"


@pytest.fixture
def eval_dir(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "gsm8k.jsonl").write_text(json.dumps({"turns": [EVAL_TURN + "\n" + MATH_SUFFIX]}) + "\n")
    (folder / "mt-bench.jsonl").write_text(
        json.dumps({"turns": ["Compose an engaging travel blog post about a recent trip to Hawaii.", "Rewrite it."]})
        + "\n" + json.dumps({"turns": ["hi"]}) + "\n")
    return folder


def endless(domain: str, name: str) -> PromptSource:
    """A fake unlimited source whose texts depend on the rng it is given."""

    def candidates(rng):
        for i in range(10**6):
            yield f"{name}:{i}", f"{domain} prompt {i} from {name}, variant {rng.randrange(10**9)}"

    return PromptSource(name, domain, 1.0, candidates)


def finite(domain: str, name: str, texts: list[str]) -> PromptSource:
    return PromptSource(name, domain, 1.0, lambda rng: ((f"{name}:{t}", t) for t in texts))


FAKE = [endless("math", "m"), endless("code", "c1"), endless("code", "c2"), endless("chat", "h")]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_file_and_other_seed_differs(tmp_path, eval_dir):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        build_prompt_set(tmp_path / f"{name}.jsonl", 30, seed=seed, eval_dir=eval_dir, sources=FAKE, progress=False)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()


def test_record_shape_and_exact_mixture(tmp_path, eval_dir):
    out = tmp_path / "p.jsonl"
    summary = build_prompt_set(out, 41, mix="math=0.5,code=0.25,chat=0.25", eval_dir=eval_dir, sources=FAKE,
                               progress=False)
    records = read(out)
    assert Counter(r["domain"] for r in records) == {"math": 21, "code": 10, "chat": 10}  # 20.5/10.25/10.25
    assert summary.written == {"math": 21, "code": 10, "chat": 10}
    assert len({r["id"] for r in records}) == 41
    for r in records:
        assert set(r) == {"id", "domain", "source", "conversations"}
        assert r["conversations"] == [{"role": "user", "content": r["conversations"][0]["content"]}]
    assert {r["source"] for r in records if r["domain"] == "code"} == {"c1", "c2"}  # both sources drawn


def test_prompts_matching_an_eval_first_turn_are_dropped(tmp_path, eval_dir):
    clashes = [
        "  janet has 16 DUCKS that lay eggs every single day of the week.   How many eggs does she collect?",
        f"Please help: {EVAL_TURN} Thanks!",                        # contains an eval first turn
        "an engaging travel blog post about a recent trip to Hawaii",  # lies inside one
    ]
    fine = ["Say hi to my friend", "Write a haiku about autumn leaves falling slowly."]  # "hi": too short to count
    source = finite("chat", "f", clashes + fine)
    out = tmp_path / "p.jsonl"
    summary = build_prompt_set(out, 5, mix="chat=1", eval_dir=eval_dir, sources=[source], progress=False,
                               max_eval_overlap=None, allow_short=True)
    texts = {r["conversations"][0]["content"] for r in read(out)}
    assert texts == {t for t in fine if not is_reserved(f"f:{t}")}
    assert summary.dropped.get("eval_match") == sum(not is_reserved(f"f:{t}") for t in clashes)
    # negative control: with an eval folder that lacks these turns, the same prompts are kept
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.jsonl").write_text(json.dumps({"turns": ["Something entirely different and long enough."]}) + "\n")
    build_prompt_set(out, 5, mix="chat=1", eval_dir=other, sources=[source], progress=False, max_eval_overlap=None,
                     allow_short=True)
    kept = {r["conversations"][0]["content"] for r in read(out)}
    assert kept >= set(clashes) - {t for t in clashes if is_reserved(f"f:{t}")}


def test_template_copies_with_new_numbers_are_dropped_by_ngram_overlap(tmp_path, eval_dir):
    copy = "Maria has 23 geese that lay eggs every single day of the week. How many eggs does she collect?"
    index = EvalIndex.from_dir(eval_dir)
    assert not index.matches(normalise(copy)) and index.overlap(normalise(copy)) > 0.5
    assert index.overlap(normalise("Write a haiku about autumn leaves falling slowly in the park.")) == 0.0
    # the math suffix alone does not count as overlap
    assert index.overlap(normalise(f"A train leaves at noon and travels far.\n{MATH_SUFFIX}")) == 0.0


def test_duplicates_are_dropped(tmp_path, eval_dir):
    source = finite("chat", "f", ["Tell me a story.", "tell   me a STORY.", "Another one please."])
    out = tmp_path / "p.jsonl"
    summary = build_prompt_set(out, 10, mix="chat=1", eval_dir=eval_dir, sources=[source], progress=False,
                               allow_short=True)
    texts = [normalise(r["conversations"][0]["content"]) for r in read(out)]
    assert len(texts) == len(set(texts)) and summary.dropped.get("duplicate", 0) <= 1


def test_shortfall_is_an_error_unless_allowed(tmp_path, eval_dir):
    source = finite("chat", "f", [f"Question number {i}, please answer it." for i in range(30)])
    with pytest.raises(DSparkError, match="--allow-short"):
        build_prompt_set(tmp_path / "p.jsonl", 40, mix="chat=1", eval_dir=eval_dir, sources=[source], progress=False)
    summary = build_prompt_set(tmp_path / "p.jsonl", 40, mix="chat=1", eval_dir=eval_dir, sources=[source],
                               progress=False, allow_short=True)
    assert 20 <= summary.written["chat"] < 30  # about one item in ten is reserved for the substitute


def test_alpaca_substitute_is_disjoint_from_training(tmp_path, eval_dir):
    train, sub = tmp_path / "train.jsonl", tmp_path / "alpaca-substitute.jsonl"
    build_prompt_set(train, 200, mix="code=0.5,chat=0.5", eval_dir=eval_dir, sources=FAKE, progress=False)
    summary = substitute_alpaca(sub, 30, eval_dir=eval_dir, sources=FAKE, progress=False)
    records = read(sub)
    assert len(records) == summary.written["substitute"] == 30
    assert all(set(r) == {"turns", "source"} and r["source"].startswith("alpaca-substitute/") for r in records)
    train_texts = {normalise(r["conversations"][0]["content"]) for r in read(train)}
    assert not train_texts & {normalise(r["turns"][0]) for r in records}
    assert {r["source"] for r in records} <= {"alpaca-substitute/c1", "alpaca-substitute/c2", "alpaca-substitute/h"}


def test_reservation_rate_is_about_one_in_ten():
    share = sum(is_reserved(f"item:{i}") for i in range(20000)) / 20000
    assert 0.09 < share < 0.11  # binomial sd 0.002


def test_parse_mix():
    assert parse_mix("math=2,code=1,chat=1") == {"math": 0.5, "code": 0.25, "chat": 0.25}
    assert parse_mix("chat=1") == {"math": 0.0, "code": 0.0, "chat": 1.0}
    for bad in ("maths=1", "math=-1,chat=2", "math=0", "math"):
        with pytest.raises(DSparkError):
            parse_mix(bad)


def test_eval_folder_without_turns_is_an_error(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DSparkError, match="turns"):
        EvalIndex.from_dir(tmp_path)
    with pytest.raises(DSparkError, match="no"):
        EvalIndex.from_dir(tmp_path / "missing")


def test_offline_code_and_chat_sources(tmp_path, eval_dir):
    """Real package data: stdlib and pydoc topics always exist; codeio/chatterbot when installed."""
    out = tmp_path / "p.jsonl"
    build_prompt_set(out, 16, mix="code=0.5,chat=0.5", seed=3, eval_dir=eval_dir, progress=False)
    records = read(out)
    assert Counter(r["domain"] for r in records) == {"code": 8, "chat": 8}
    assert {r["source"] for r in records} <= {"codeio", "stdlib", "chatterbot", "python_docs", "pydoc_topics",
                                              "stdlib_docs", "openai_evals"}
    for r in records:
        assert 0 < len(r["conversations"][0]["content"]) <= 6000


def test_stdlib_functions_come_from_the_running_python():
    source = next(s for s in default_sources() if s.name == "stdlib")
    items = [c for _, c in zip(range(20), source.candidates(random.Random(0)))]
    assert all(key.startswith("stdlib:") and "```python\n" in text for key, text in items)
    assert len({key.split(":")[1] for key, _ in items}) >= 5  # several modules early on


def test_math_prompts_from_reasoning_gym(tmp_path, eval_dir):
    pytest.importorskip("reasoning_gym")
    out = tmp_path / "m.jsonl"
    build_prompt_set(out, 6, mix="math=1", eval_dir=eval_dir, progress=False)
    records = read(out)
    assert len(records) == 6 and {r["source"] for r in records} <= {"gsm_symbolic", "rg_math"}
    for r in records:
        text = r["conversations"][0]["content"]
        assert text.endswith("\n" + MATH_SUFFIX) and "Give the result as your final answer" not in text


def test_missing_reasoning_gym_names_the_extra(tmp_path, eval_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "reasoning_gym", None)  # makes the import fail
    with pytest.raises(DSparkError, match=r"dspark\[data\]"):
        build_prompt_set(tmp_path / "m.jsonl", 2, mix="math=1", eval_dir=eval_dir, progress=False)


def test_openai_evals_data_from_a_folder(tmp_path):
    data = tmp_path / "registry" / "data"
    (data / "riddles").mkdir(parents=True)
    (data / "aime_evaluation").mkdir()
    rows = [{"input": [{"role": "system", "content": "Answer briefly."},
                       {"role": "user", "content": f"What has keys but opens no locks? ({i})"}], "ideal": "piano"}
            for i in range(3)]
    (data / "riddles" / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (data / "aime_evaluation" / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = next(s for s in default_sources(evals_path=data) if s.name == "openai_evals")
    items = list(source.candidates(random.Random(0)))
    assert len(items) == 3 and all(k.startswith("evals:riddles/") for k, _ in items)  # aime_* skipped
    assert all(t.startswith("Answer briefly.\n\nWhat has keys") for _, t in items)
