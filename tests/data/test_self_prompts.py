"""Prompts the target writes itself (Magpie): the user prefix, the judge, the draw plan, and the whole set through
the engine on a tiny target: records, determinism across batch sizes, the evaluation filter, --exclude."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dspark.data.self_prompts import (STARTERS, Draw, build_self_prompt_set, judge, plan_draws, user_prefix)
from dspark.errors import DSparkError
from tests.tiny import tiny_target

STOPS = [1, 7, 8, 9, 10]  # ends of turn: short samples on a random tiny target


class TextChatTokenizer:
    """Characters to ids (6..95); ids decode to a few letters and spaces, so random samples have words."""

    chat_template = "<system>{s}</system><user>{u}</user><assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [6 + (ord(c) - 32) % 90 for c in text]

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(" etaoinshr"[i % 10] if i >= 6 else ("" if skip_special_tokens else f"<{i}>") for i in ids)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kwargs):
        turns = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        text = "<system>default</system>" + turns
        return self.encode(text) if tokenize else text


def chat_target():
    target = tiny_target(sharp=1.0)
    target.tokenizer = TextChatTokenizer()
    target.eos_token_ids = STOPS
    return target


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_user_prefix_cuts_the_template_where_the_users_content_starts():
    assert user_prefix(chat_target()) == "<system>default</system><user>"


def test_user_prefix_needs_a_chat_template():
    target = chat_target()
    target.tokenizer.chat_template = None
    with pytest.raises(DSparkError, match="chat template"):
        user_prefix(target)


@pytest.mark.parametrize("draw, reason", [
    (Draw(0, "chat", "", "What is a good way to learn to cook at home?", True), None),
    (Draw(0, "chat", "", "What is a good way to learn to cook at home?", False), "unfinished"),
    (Draw(0, "chat", "", "Hi there friend", True), "short"),
    (Draw(0, "chat", "", "one two three", True), "short"),
    (Draw(0, "chat", "", "word " * 500, True), "long"),
    (Draw(0, "chat", "", "Что такое хорошая книга для чтения летом?", True), "unreadable"),
])
def test_judge_keeps_finished_readable_requests_only(draw, reason):
    assert judge(draw) == reason


def test_plan_draws_is_fixed_by_seed_and_index_and_follows_the_counts():
    counts = {"math": 600, "code": 0, "chat": 400}
    a = plan_draws(counts, seed=3, start=0, n=2000)
    assert [(d.domain, d.starter) for d in a[100:200]] == \
        [(d.domain, d.starter) for d in plan_draws(counts, seed=3, start=100, n=100)]
    assert [(d.domain, d.starter) for d in a] != [(d.domain, d.starter) for d in plan_draws(counts, 4, 0, 2000)]
    share = Counter(d.domain for d in a)
    assert share["code"] == 0 and 0.55 < share["math"] / 2000 < 0.65
    assert all(d.starter in STARTERS[d.domain] for d in a)


def test_self_prompt_set_records_and_determinism_across_batch_sizes(tmp_path):
    target = chat_target()
    kwargs = dict(mix="math=0.5,chat=0.5", seed=5, max_new_tokens=24, max_eval_overlap=None, allow_short=True,
                  max_draws=96, progress=False)
    summary, stats = build_self_prompt_set(target, tmp_path / "a.jsonl", 12, batch_size=4, **kwargs)
    rows = read(tmp_path / "a.jsonl")
    assert stats.drawn <= 96 and sum(stats.rejected.values()) > 0  # some samples are not requests
    assert 0 < len(rows) <= 12 and summary.written == dict(Counter(r["domain"] for r in rows))
    for r in rows:
        assert r["source"] == "self_prompts" and r["domain"] in ("math", "chat")
        text = r["conversations"][0]["content"]
        assert r["id"].startswith("self_prompts-") and judge(Draw(0, r["domain"], "", text, True)) is None
        if r["domain"] == "math":
            assert any(text.startswith(s) for s in STARTERS["math"])
    assert len({r["id"] for r in rows}) == len(rows)
    build_self_prompt_set(target, tmp_path / "b.jsonl", 12, batch_size=7, **kwargs)
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    build_self_prompt_set(target, tmp_path / "c.jsonl", 12, batch_size=4, **{**kwargs, "seed": 6})
    assert (tmp_path / "c.jsonl").read_bytes() != (tmp_path / "a.jsonl").read_bytes()


def test_exclude_and_evaluation_sets_keep_prompts_out(tmp_path):
    target = chat_target()
    kwargs = dict(mix="math=1", seed=5, max_new_tokens=24, allow_short=True, max_draws=64, progress=False,
                  batch_size=8)
    build_self_prompt_set(target, tmp_path / "first.jsonl", 6, max_eval_overlap=None, **kwargs)
    first = [r["conversations"][0]["content"] for r in read(tmp_path / "first.jsonl")]
    assert first
    # the same seed with the first file excluded: none of its prompts again, each counted as excluded
    summary, _ = build_self_prompt_set(target, tmp_path / "second.jsonl", 6, max_eval_overlap=None,
                                       exclude=[tmp_path / "first.jsonl"], **kwargs)
    second = [r["conversations"][0]["content"] for r in read(tmp_path / "second.jsonl")]
    assert not set(first) & set(second) and summary.dropped["excluded"] >= len(first)
    # an evaluation set holding the first prompts: they are dropped as evaluation matches
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "set.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in first))
    summary, _ = build_self_prompt_set(target, tmp_path / "third.jsonl", 6, eval_dir=evals, **kwargs)
    third = [r["conversations"][0]["content"] for r in read(tmp_path / "third.jsonl")]
    assert not set(first) & set(third) and summary.dropped["eval_match"] >= len(first)


def test_too_few_usable_samples_is_a_one_line_error(tmp_path):
    with pytest.raises(DSparkError, match=r"8 samples gave too few usable prompts \(math \d+/50\)"):
        build_self_prompt_set(chat_target(), tmp_path / "x.jsonl", 50, mix="math=1", max_draws=8, batch_size=4,
                              max_eval_overlap=None, progress=False)
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("flag", ["--batch-size", "--max-new-tokens", "--max-draws"])
def test_cli_refuses_counts_below_one_in_one_line(flag, capsys):
    import argparse

    from dspark.data.cli import add_cli

    parser = argparse.ArgumentParser(prog="dspark")
    add_cli(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "self-prompts", "--out", "x.jsonl", "--num", "5", flag, "0"])
    assert f"argument {flag}: expected a number >= 1, got 0" in capsys.readouterr().err
