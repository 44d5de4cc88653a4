"""Draft vocabularies from a tokenized set: counting, choosing the tokens, `dspark data vocab`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark.data.tokenized import TokenizedDataset, write_tokenized
from dspark.data.vocab import build_draft_vocab, count_tokens
from dspark.drafters.draft_vocab import load_draft_vocab
from dspark.errors import DSparkError


def test_build_keeps_the_most_frequent_then_lower_ids_and_forced_tokens():
    counts = np.array([5, 0, 3, 3, 1])
    assert build_draft_vocab(counts, 3) == ([0, 2, 3], pytest.approx(11 / 12))
    ids, cov = build_draft_vocab(counts, 3, always=[4])
    assert ids == [4, 0, 2] and cov == pytest.approx(9 / 12)
    with pytest.raises(DSparkError):
        build_draft_vocab(counts, 0)


def _tokenized(tmp_path):
    from tests.training import smollm2_tokenizer

    rows = [{"id": f"s{i}", "status": "success", "conversations": [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "yes " * (i + 3)}]}
        for i in range(3)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_tokenized(tmp_path / "r.jsonl", smollm2_tokenizer(), tmp_path / "tok", 64, min_loss_tokens=1,
                    progress=False)
    return tmp_path / "tok"


def test_data_vocab_cli_writes_a_loadable_file(tmp_path, capsys):
    from dspark.cli import main

    tok = _tokenized(tmp_path)
    assert main(["data", "vocab", "--data", str(tok), "--size", "10", "--out", str(tmp_path / "v.json")]) == 0
    assert "covering" in capsys.readouterr().out
    ids = load_draft_vocab(tmp_path / "v.json", 49152)
    data = json.loads((tmp_path / "v.json").read_text())
    assert len(ids) == 10 and data["coverage"] > 0.5 and 2 in ids  # SmolLM2's <|im_end|> is always kept


def test_count_tokens_counts_supervised_tokens_only(tmp_path):
    _tokenized(tmp_path)
    counts = count_tokens(tmp_path / "tok", 49152)
    ds = TokenizedDataset(tmp_path / "tok")
    by_hand = np.zeros(49152, dtype=np.int64)
    for i in range(len(ds)):
        for t, m in zip(ds[i]["input_ids"].tolist(), ds[i]["loss_mask"].tolist()):
            by_hand[t] += m
    assert np.array_equal(counts, by_hand) and counts.sum() > 0
