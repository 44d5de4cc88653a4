import argparse
import json
import pickle

import pytest
import torch

from dspark.errors import DSparkError
from dspark.data.chat import tokenize_conversation
from dspark.data.cli import add_cli
from dspark.data.tokenized import TokenizedDataset, collate_padded, pack_batches, write_tokenized
from tests.training import smollm2_tokenizer


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what is {i} times three?"},
            {"role": "assistant", "content": f"{i} times three is {3 * i}. " + "Let me explain why. " * (i + 1)}]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture
def regenerated(tmp_path):
    rows = [{"id": f"s{i}", "conversations": conversation(i), "status": "success"} for i in range(4)]
    rows.insert(1, {"id": "bad", "conversations": conversation(9), "status": "error", "error": "timeout"})
    rows.append({"id": "prompt-only", "conversations": conversation(5)[:1], "status": "success"})
    rows.append({"id": "short", "conversations": [{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Hello."}], "status": "success"})
    path = tmp_path / "regenerated.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_round_trip(tok, regenerated, tmp_path):
    summary = write_tokenized(regenerated, tok, tmp_path / "tok", max_length=64, progress=False)
    assert summary.skipped == {"status": 1, "no_assistant_turn": 1, "few_loss_tokens": 1}
    dataset = TokenizedDataset(tmp_path / "tok")
    assert len(dataset) == summary.num_samples == 4
    for i in range(4):
        expected = tokenize_conversation(tok, conversation(i), max_length=64)
        sample = dataset[i]
        assert sample["input_ids"].dtype == sample["loss_mask"].dtype == torch.long
        assert sample["input_ids"].tolist() == expected["input_ids"]
        assert sample["loss_mask"].tolist() == expected["loss_mask"]
    assert dataset[3]["input_ids"].shape == (64,)  # the longest sample is truncated
    assert dataset[-1]["input_ids"].tolist() == dataset[3]["input_ids"].tolist()
    assert dataset.manifest["num_loss_tokens"] == sum(int(dataset[i]["loss_mask"].sum()) for i in range(4))
    with pytest.raises(IndexError):
        dataset[4]
    clone = pickle.loads(pickle.dumps(dataset))  # as a spawned DataLoader worker receives it
    assert clone._arrays is None and clone[2]["input_ids"].tolist() == dataset[2]["input_ids"].tolist()


def test_missing_or_empty_inputs_are_clear_errors(tok, tmp_path):
    with pytest.raises(DSparkError, match="does not exist"):
        write_tokenized(tmp_path / "nope.jsonl", tok, tmp_path / "tok", 64, progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": "x", "conversations": conversation(1), "status": "error"}) + "\n")
    with pytest.raises(DSparkError, match="no usable samples"):
        write_tokenized(empty, tok, tmp_path / "tok", 64, progress=False)
    with pytest.raises(DSparkError, match="dspark data tokenize"):
        TokenizedDataset(tmp_path)


def test_pack_batches_respects_the_token_budget():
    lengths = [5, 100, 7, 30, 31, 6, 90, 400, 29, 8]
    batches = pack_batches(lengths, max_tokens=100, seed=0)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each sample exactly once
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 100
    assert [7] in batches  # longer than the budget: alone
    assert sorted(map(sorted, batches)) == sorted(map(sorted, pack_batches(lengths, 100, shuffle=False)))
    assert batches == pack_batches(lengths, 100, seed=0)
    # negative control: one batch per sample when the budget fits only the shortest sample
    assert len(pack_batches(lengths, max_tokens=5)) == len(lengths)


def test_collate_pads_right():
    samples = [{"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])},
               {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1])}]
    batch = collate_padded(samples, pad_token_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_cli_tokenize_and_prompts(regenerated, tmp_path):
    parser = argparse.ArgumentParser(prog="dspark")
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["data", "tokenize", "--in", str(regenerated), "--target", "smollm2-135m",
                              "--out", str(tmp_path / "tok"), "--max-length", "64"])
    args.func(args)
    assert len(TokenizedDataset(tmp_path / "tok")) == 4

    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "x.jsonl").write_text(json.dumps({"turns": ["An evaluation question that is long enough."]}) + "\n")
    args = parser.parse_args(["data", "prompts", "--out", str(tmp_path / "p.jsonl"), "--num", "4", "--mix",
                              "code=1", "--source-weights", "codeio=0", "--eval-dir", str(eval_dir)])
    args.func(args)
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["source"] for r in records] == ["stdlib"] * 4
