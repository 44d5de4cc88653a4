"""Regenerating assistant turns with the target: record shape, multi-turn history, errors, resume."""

from __future__ import annotations

import json

import pytest

from dspark.data.regenerate import error_path, regenerate
from tests.tiny import tiny_target

ROLE_IDS = {"system": 2, "user": 3, "assistant": 4}
END = 5  # end of a message; the tiny target's eos is 1


class CharTokenizer:
    """A tiny chat tokenizer over the tiny target's 96 ids: one id per character (6..95)."""

    chat_template = "role-char-end"
    eos_token_id = 1

    def __init__(self) -> None:
        self.rendered: list[list[dict]] = []  # every conversation rendered for a prompt

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [6 + (ord(c) % 90) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        self.rendered.append([dict(m) for m in messages])
        ids = []
        for m in messages:
            ids += [ROLE_IDS[m["role"]]] + self.encode(m["content"]) + [END]
        if add_generation_prompt:
            ids.append(ROLE_IDS["assistant"])
        return ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(chr(ord("!") + (i - 6) % 90) if i >= 6 else ("" if skip_special_tokens else f"<{i}>")
                       for i in ids)


def chat_target():
    target = tiny_target()
    target.tokenizer = CharTokenizer()
    return target


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


RECORDS = [
    {"id": "a", "domain": "math", "conversations": [{"role": "user", "content": "one plus one"}]},
    {"id": "b", "conversations": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ORIGINAL REPLY"}, {"role": "user", "content": "and then?"}]},
    {"turns": ["a first turn", "a second turn"]},  # eval-style record, id = line number
    {"id": "long", "conversations": [{"role": "user", "content": "x" * 600}]},  # over the 512-token context
    {"id": "empty", "conversations": [{"role": "assistant", "content": "no user turn"}]},
]


def test_records_have_the_deepspec_shape_and_errors_go_aside(tmp_path):
    target = chat_target()
    src = write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    out = tmp_path / "regen.jsonl"
    stats = regenerate(target, src, out, batch_size=2, max_new_tokens=6, seed=3, progress=False)
    assert (stats.succeeded, stats.failed, stats.skipped) == (3, 2, 0)
    done = {str(r["id"]): r for r in read_jsonl(out)}
    assert set(done) == {"a", "b", "2"}
    assert done["a"]["domain"] == "math" and done["a"]["status"] == "success"
    assert [m["role"] for m in done["a"]["conversations"]] == ["user", "assistant"]
    b = done["b"]["conversations"]
    assert [m["role"] for m in b] == ["system", "user", "assistant", "user", "assistant"]
    assert b[0]["content"] == "be brief" and "ORIGINAL REPLY" not in json.dumps(b)
    assert [m["role"] for m in done["2"]["conversations"]] == ["user", "assistant", "user", "assistant"]
    errors = {r["id"]: r for r in read_jsonl(error_path(out))}
    assert set(errors) == {"long", "empty"} and all(r["status"] == "error" and r["error"] for r in errors.values())
    assert "context" in errors["long"]["error"]


def test_each_turn_sees_the_regenerated_history(tmp_path):
    target = chat_target()
    src = write_jsonl(tmp_path / "p.jsonl", [RECORDS[1]])
    out = tmp_path / "o.jsonl"
    regenerate(target, src, out, max_new_tokens=4, progress=False)
    final = read_jsonl(out)[0]["conversations"]
    second_prompt = target.tokenizer.rendered[-1]  # what the target was asked for the second reply
    assert second_prompt == final[:4]  # system, user, the *regenerated* reply, user
    assert second_prompt[2]["content"] == final[2]["content"] != "ORIGINAL REPLY"


def test_seeded_output_is_reproducible_and_sampling_varies_with_the_seed(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:3])
    texts = []
    for name, seed in (("x", 5), ("y", 5), ("z", 6)):
        out = tmp_path / f"{name}.jsonl"
        regenerate(chat_target(), src, out, batch_size=3, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0,
                   seed=seed, progress=False)
        texts.append(out.read_text())
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]  # negative control: a different seed gives different samples


def test_resume_skips_done_ids_and_cuts_a_torn_line(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:3])
    out = tmp_path / "o.jsonl"
    first = regenerate(chat_target(), src, out, max_new_tokens=4, limit=1, progress=False)
    assert first.succeeded == 1
    kept = out.read_text()
    with open(out, "a") as f:
        f.write('{"id": "b", "conversations": [')  # killed mid-write
    again = regenerate(chat_target(), src, out, max_new_tokens=4, progress=False)
    assert (again.skipped, again.succeeded) == (1, 2)
    assert out.read_text().startswith(kept)
    ids = [str(r["id"]) for r in read_jsonl(out)]
    assert ids == ["a", "b", "2"]


def test_needs_a_tokenizer(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:1])
    with pytest.raises(Exception, match="tokenizer"):
        regenerate(tiny_target(), src, tmp_path / "o.jsonl", progress=False)


MULTI = RECORDS + [
    {"id": f"m{i}", "conversations": [{"role": "user", "content": "q" * (3 + 5 * i)},
                                      {"role": "assistant", "content": "old"},
                                      {"role": "user", "content": f"follow-up {i}"}]}
    for i in range(5)
]


@pytest.mark.parametrize("engine_batch", [1, 3])
def test_the_engine_writes_the_records_of_static_batches(tmp_path, engine_batch):
    """Continuous batching changes when a turn runs, never what it samples: each turn's seed is fixed by
    (seed, line, turn). Sampled at temperature 1 with varied lengths, so batches really mix."""
    src = write_jsonl(tmp_path / "p.jsonl", MULTI)
    files = {}
    for name, batch, static in (("static", 4, True), ("engine", engine_batch, False)):
        out = tmp_path / f"{name}.jsonl"
        stats = regenerate(chat_target(), src, out, batch_size=batch, max_new_tokens=12, temperature=1.0,
                           top_p=1.0, top_k=0, seed=7, progress=False, static_batches=static)
        assert (stats.succeeded, stats.failed) == (8, 2)
        files[name] = (out.read_text(), error_path(out).read_text(), stats.new_tokens)
    assert files["engine"] == files["static"]
    lengths = {len(m["content"]) for r in read_jsonl(tmp_path / "engine.jsonl") for m in r["conversations"]
               if m["role"] == "assistant"}
    assert len(lengths) > 1  # answers of different lengths: requests left and joined the engine's batch


def test_a_different_seed_changes_the_engine_records(tmp_path):
    """Negative control for the equality above: the records do depend on what each turn samples."""
    src = write_jsonl(tmp_path / "p.jsonl", MULTI)
    texts = []
    for seed in (7, 8):
        out = tmp_path / f"{seed}.jsonl"
        regenerate(chat_target(), src, out, batch_size=3, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0,
                   seed=seed, progress=False)
        texts.append(out.read_text())
    assert texts[0] != texts[1]


def test_shards_together_write_the_unsharded_records_and_merge_puts_them_in_prompt_order(tmp_path):
    from dspark.data.regenerate_io import merge_shards

    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:3] + [{"id": "d", "conversations": [
        {"role": "user", "content": "two more"}]}])
    sampling = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, seed=5, progress=False)
    whole = tmp_path / "whole.jsonl"
    regenerate(chat_target(), src, whole, batch_size=4, **sampling)
    shards = [tmp_path / f"s{k}.jsonl" for k in (0, 1)]
    for k, out in enumerate(shards):
        stats = regenerate(chat_target(), src, out, batch_size=4, shard=(k, 2), **sampling)
        assert stats.total == 2 and stats.succeeded == 2
    assert [str(r["id"]) for r in read_jsonl(shards[1])] == ["b", "d"]  # lines 1 and 3
    merged = tmp_path / "merged.jsonl"
    assert merge_shards(src, shards, merged) == 4
    assert merged.read_text() == whole.read_text()  # seeds follow the line in the whole file


def test_merge_refuses_an_unfinished_shard_and_a_bad_shard_spec(tmp_path):
    from dspark.data.regenerate_io import merge_shards, parse_shard
    from dspark.errors import DSparkError

    src = write_jsonl(tmp_path / "p.jsonl", RECORDS[:3])
    shard = tmp_path / "s0.jsonl"
    regenerate(chat_target(), src, shard, max_new_tokens=4, shard=(0, 2), progress=False)
    with pytest.raises(DSparkError, match=r"1 of 3 prompts .* no record .*\(first: b\)"):
        merge_shards(src, [shard], tmp_path / "m.jsonl")
    assert not (tmp_path / "m.jsonl").exists()
    with pytest.raises(DSparkError, match=r"nope.jsonl not found"):
        merge_shards(tmp_path / "nope.jsonl", [shard], tmp_path / "m.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n[1, 2]\n')
    with pytest.raises(DSparkError, match=r"bad.jsonl:2: not a regenerated record"):
        merge_shards(src, [bad], tmp_path / "m.jsonl")
    assert parse_shard("1/2") == (1, 2) and parse_shard(None) is None
    for bad in ("2/2", "x", "1/0", "-1/2"):
        with pytest.raises(DSparkError, match="bad --shard"):
            parse_shard(bad)
