"""Where the evaluation sets come from: the package itself unless --eval-dir / $DSPARK_EVAL_DIR say otherwise."""

import json
import re
from pathlib import Path

import pytest

import dspark
from dspark.data.decontaminate import EvalIndex, is_reserved, normalise
from dspark.data.eval_sets import (
    BENCHMARKS,
    DatasetError,
    find_eval_dir,
    load_eval_dataset,
    packaged_eval_dir,
    read_first_turns,
)
from dspark.data.prompt_sources import PromptSource
from dspark.data.prompts import build_prompt_set
from dspark.errors import DSparkError


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """No override and a working directory outside the repository (a user's fresh shell)."""
    monkeypatch.delenv("DSPARK_EVAL_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_default_resolution_finds_the_packaged_sets_from_anywhere(outside):
    folder = find_eval_dir()
    assert folder == packaged_eval_dir() and Path(dspark.__file__).resolve().parent in folder.resolve().parents
    assert "shared" not in folder.resolve().parts
    for name in BENCHMARKS:
        dataset = load_eval_dataset(name, limit=2)
        assert len(dataset) == 2 and Path(dataset.source).parent == folder
        assert all(isinstance(s.prompt, str) and s.prompt.strip() for s in dataset.samples)


def test_packaged_sets_have_the_rows_their_sources_file_lists(outside):
    folder = find_eval_dir()
    table = re.findall(r"^\| (\S+\.jsonl) \| (\d+) \|", (folder / "SOURCES.md").read_text(), re.MULTILINE)
    assert {file for file, _ in table} == {f"{name}.jsonl" for name in BENCHMARKS}
    for file, rows in table:
        assert len(read_first_turns(folder / file)) == int(rows), file


def test_eval_dir_and_environment_override_the_package(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "gsm8k.jsonl").write_text(json.dumps({"turns": ["What is 2 + 2?"]}) + "\n")
    monkeypatch.setenv("DSPARK_EVAL_DIR", str(mine))
    assert find_eval_dir() == mine
    assert load_eval_dataset("gsm8k").samples[0].prompt == "What is 2 + 2?"
    assert find_eval_dir(packaged_eval_dir()) == packaged_eval_dir()  # --eval-dir wins over the environment
    with pytest.raises(DSparkError, match="--eval-dir"):
        find_eval_dir(tmp_path / "missing")
    monkeypatch.setenv("DSPARK_EVAL_DIR", str(tmp_path / "missing"))
    with pytest.raises(DatasetError, match="DSPARK_EVAL_DIR.*--eval-dir"):
        find_eval_dir()


def test_decontamination_reads_first_turns_like_evaluation(tmp_path):
    """One reader of first turns: the training-prompt filter sees exactly what evaluation decodes."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"turns": ["First question here?", "a follow-up"]}) + "\n\n"
                                      + json.dumps({"turns": ["Second   QUESTION."]}) + "\n")
    index = EvalIndex.from_dir(tmp_path)
    assert index.turns == {normalise(t) for t in read_first_turns(tmp_path / "a.jsonl")}
    (tmp_path / "b.jsonl").write_text(json.dumps({"turns": [7]}) + "\n")
    for read in (lambda: EvalIndex.from_dir(tmp_path), lambda: read_first_turns(tmp_path / "b.jsonl")):
        with pytest.raises(DSparkError, match=r"b\.jsonl:1 needs a non-empty \"turns\" list"):
            read()


def test_training_prompts_stay_disjoint_from_the_packaged_sets_by_default(outside):
    gsm8k = read_first_turns(packaged_eval_dir() / "gsm8k.jsonl")[0]
    texts = [gsm8k, "Tell me about the history of the bicycle, please.", "How do tides work on Earth?"]
    keys = [k for k in (f"f:{i}" for i in range(100)) if not is_reserved(k)][: len(texts)]  # all for training
    source = PromptSource("f", "chat", 1.0, lambda rng: zip(keys, texts))
    summary = build_prompt_set(outside / "p.jsonl", 3, mix="chat=1", sources=[source], progress=False,
                               allow_short=True)
    written = [json.loads(line)["conversations"][0]["content"] for line in (outside / "p.jsonl").open()]
    assert sorted(written) == sorted(texts[1:]) and summary.dropped == {"eval_match": 1}
