"""`dspark data label` (teacher-forced labelling of existing text): records, disjointness from the evaluation
sets, determinism, the domain mix, loss-mask value 2 through tokenize and the feature cache, the CLI."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from dspark.cli import main
from dspark.data.chat import TEACHER_FORCED, tokenize_conversation
from dspark.data.decontaminate import EvalIndex, is_reserved, normalise
from dspark.data.eval_sets import find_eval_dir
from dspark.data.features import FeatureCacheDataset, build_feature_cache
from dspark.data.label import DEFAULT_WEIGHTS, LabelSource, build_label_set, default_label_sources
from dspark.data.tokenized import TokenizedDataset, write_tokenized
from dspark.drafters.losses import TARGET_LABEL
from dspark.errors import DSparkError
from tests.tiny import tiny_target
from tests.training import smollm2_tokenizer

EVAL_TURN = "Compose an engaging travel blog post about a recent trip to Hawaii, with cultural experiences."


@pytest.fixture
def eval_dir(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "mt-bench.jsonl").write_text(json.dumps({"turns": [EVAL_TURN, "Rewrite it."]}) + "\n")
    return folder


def endless(domain: str, name: str) -> LabelSource:
    """A fake unlimited source whose texts depend on the rng it is given."""

    def pairs(rng, max_chars):
        for i in range(10**6):
            v = rng.randrange(10**9)
            yield f"{name}:{i}", [{"role": "user", "content": f"{domain} question {i} from {name}, variant {v}"},
                                  {"role": "assistant", "content": f"the existing answer {i} of {name}, {v}"}]

    return LabelSource(name, domain, 1.0, pairs)


FAKE = [endless("math", "m"), endless("code", "c1"), endless("code", "c2"), endless("chat", "h")]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def well_formed(record: dict) -> bool:
    turns = record["conversations"]
    roles = [m["role"] for m in turns]
    return (set(record) >= {"id", "conversations", "status", "label", "source", "domain"}
            and record["status"] == "success" and record["label"] == TEACHER_FORCED
            and roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) >= 2
            and all(isinstance(m["content"], str) and m["content"].strip() for m in turns))


def test_same_seed_same_file_other_seed_differs(tmp_path, eval_dir):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        build_label_set(tmp_path / f"{name}.jsonl", 30, seed=seed, eval_dir=eval_dir, sources=FAKE, progress=False)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()


def test_records_and_exact_mixture(tmp_path, eval_dir):
    out = tmp_path / "l.jsonl"
    summary = build_label_set(out, 41, mix="math=0.5,code=0.25,chat=0.25", eval_dir=eval_dir, sources=FAKE,
                              progress=False)
    records = read(out)
    assert all(well_formed(r) for r in records)
    assert Counter(r["domain"] for r in records) == {"math": 21, "code": 10, "chat": 10} == summary.written
    assert set(Counter(r["source"] for r in records)) == {"m", "c1", "c2", "h"}
    assert len({r["id"] for r in records}) == 41
    assert not (tmp_path / "l.jsonl.tmp").exists()  # written atomically


def test_answers_matching_an_eval_turn_are_dropped(tmp_path, eval_dir):
    keys = [k for k in (f"x:{i}" for i in range(50)) if not is_reserved(k)]  # items of the training split

    def pairs(rng, max_chars):
        yield keys[0], [{"role": "user", "content": "Write me something about a trip, please."},
                      {"role": "assistant", "content": f"Sure. {EVAL_TURN}"}]  # the answer quotes an eval turn
        yield keys[1], [{"role": "user", "content": "Write me something about a trip, please!"},
                      {"role": "assistant", "content": "Sure. A fine trip to the mountains."}]

    source = LabelSource("x", "chat", 1.0, pairs)
    summary = build_label_set(tmp_path / "l.jsonl", 1, mix="chat=1", eval_dir=eval_dir, sources=[source],
                              progress=False)
    assert [r["conversations"][1]["content"] for r in read(tmp_path / "l.jsonl")] == [
        "Sure. A fine trip to the mountains."]
    assert summary.dropped == {"answer_eval_match": 1}
    # negative control: without the eval turn in the folder, the first pair is taken
    (eval_dir / "mt-bench.jsonl").write_text(json.dumps({"turns": ["Something else entirely, about cooking."]}) + "\n")
    build_label_set(tmp_path / "m.jsonl", 1, mix="chat=1", eval_dir=eval_dir, sources=[source], progress=False)
    assert read(tmp_path / "m.jsonl")[0]["conversations"][1]["content"].endswith("cultural experiences.")


def test_shortfall_and_bad_input_are_clear_errors(tmp_path, eval_dir):
    with pytest.raises(DSparkError, match="only 0 of 5 math records"):
        build_label_set(tmp_path / "l.jsonl", 5, mix="math=1", eval_dir=eval_dir, sources=FAKE[1:], progress=False)
    with pytest.raises(DSparkError, match="--num must be positive"):
        build_label_set(tmp_path / "l.jsonl", 0, eval_dir=eval_dir, sources=FAKE, progress=False)
    with pytest.raises(DSparkError, match="unknown label source"):
        default_label_sources(weights={"nope": 1.0})


def test_offline_sources_give_disjoint_well_formed_records(tmp_path):
    """The real sources against the packaged evaluation sets: every domain filled, nothing matches an eval turn."""
    out = tmp_path / "l.jsonl"
    summary = build_label_set(out, 24, seed=0, max_answer_chars=3000, progress=False)
    records = read(out)
    assert len(records) == 24 and all(well_formed(r) for r in records)
    assert set(r["domain"] for r in records) == {"math", "code", "chat"}
    assert set(summary.by_source) <= set(DEFAULT_WEIGHTS)
    index = EvalIndex.from_dir(find_eval_dir(None))
    for r in records:
        for m in r["conversations"]:
            assert not index.matches(normalise(m["content"]))
        assert all(len(m["content"]) <= 3000 for m in r["conversations"] if m["role"] == "assistant")


def test_python_docs_pages_without_reserved_paragraphs(tmp_path):
    """Debian's reST sources (faked): the page title as the topic, its prose paragraphs as the answer."""
    words = " ".join(f"word{i}" for i in range(30))
    paragraphs = [f"Paragraph {i} says {words}." for i in range(40)]
    (tmp_path / "library").mkdir()
    (tmp_path / "whatsnew").mkdir()
    (tmp_path / "library" / "foo.txt").write_text(
        ":mod:`foo` --- Frobnicate things\n================================\n\n" + "\n\n".join(paragraphs) + "\n")
    (tmp_path / "whatsnew" / "3.11.txt").write_text("What's new\n==========\n\n" + paragraphs[0] + "\n")
    source = next(s for s in default_label_sources(python_doc_dir=tmp_path) if s.name == "python_docs")
    [(key, conversation)] = list(source.pairs(random.Random(0), 100_000))
    assert key == "python_docs:library/foo.txt"
    assert conversation[0]["content"] == "Explain foo --- Frobnicate things (from the Python documentation)."
    kept = [p for i, p in enumerate(paragraphs) if not is_reserved(f"python_docs:library/foo.txt:{i}")]
    assert 0 < len(kept) < len(paragraphs)  # some paragraphs are reserved for the substitute, and left out
    assert conversation[1]["content"] == "\n\n".join(kept)
    [(_, short)] = list(source.pairs(random.Random(0), len(kept[0]) + 5))  # cut at a paragraph boundary
    assert short[1]["content"] == kept[0]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_tokenize_marks_labelled_replies_with_value_2(tok, tmp_path):
    conversation = [{"role": "user", "content": "What does the function do?"},
                    {"role": "assistant", "content": "It returns the sum of its two arguments, " * 3}]
    rows = [{"id": "r", "conversations": conversation, "status": "success"},
            {"id": "l", "conversations": conversation, "status": "success", "label": TEACHER_FORCED}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = write_tokenized(path, tok, tmp_path / "tok", max_length=128, progress=False)
    ds = TokenizedDataset(tmp_path / "tok")
    regenerated, labelled = ds[0]["loss_mask"], ds[1]["loss_mask"]
    assert torch.equal(ds[0]["input_ids"], ds[1]["input_ids"])
    assert set(regenerated.tolist()) == {0, 1} and set(labelled.tolist()) == {0, TARGET_LABEL}
    assert torch.equal(labelled, regenerated * TARGET_LABEL)  # the same tokens, another value
    n = int((regenerated != 0).sum())
    m = ds.manifest
    assert (m["num_loss_tokens"], m["num_loss_tokens_regenerated"], m["num_loss_tokens_labelled"]) == (2 * n, n, n)
    assert summary.num_labelled_tokens == n and "teacher-forced" in str(summary)
    # min_loss_tokens counts supervised tokens, not the sum of the mask values
    assert tokenize_conversation(tok, conversation, 128, min_loss_tokens=n, reply_mask=TARGET_LABEL) is not None
    assert tokenize_conversation(tok, conversation, 128, min_loss_tokens=n + 1, reply_mask=TARGET_LABEL) is None


def test_feature_cache_keeps_mask_value_2(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(2, 96, (n,), generator=g),
             "loss_mask": torch.randint(0, 3, (n,), generator=g)} for n in (11, 23)]
    assert any(int((d["loss_mask"] == TARGET_LABEL).sum()) for d in data)
    out = build_feature_cache(tiny_target(), data, [0, 2], tmp_path / "cache", progress=False)
    ds = FeatureCacheDataset(out)
    for item, sample in zip(data, (ds[i] for i in range(len(data)))):
        assert torch.equal(sample.loss_mask, item["loss_mask"])  # the u8 mask keeps 2: no format change


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "labelled.jsonl"
    assert main(["data", "label", "--out", str(out), "--num", "9", "--seed", "5", "--max-answer-chars", "2500",
                 "--weights", "chatterbot=0"]) == 0
    assert "wrote 9 teacher-forced records" in capsys.readouterr().out
    records = read(out)
    assert len(records) == 9 and all(well_formed(r) for r in records)
    assert "chatterbot" not in {r["source"] for r in records}
    assert main(["data", "tokenize", "--in", str(out), "--out", str(tmp_path / "tok"), "--max-length", "512"]) == 0
    m = TokenizedDataset(tmp_path / "tok").manifest
    assert m["num_loss_tokens_labelled"] == m["num_loss_tokens"] > 0 and m["num_loss_tokens_regenerated"] == 0
    assert main(["data", "label", "--out", str(out), "--num", "3", "--weights", "stdlib"]) == 2
    assert "bad --weights 'stdlib'" in capsys.readouterr().err
