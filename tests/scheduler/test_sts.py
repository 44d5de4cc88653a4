"""The STS file (SGLang's format) and applying its temperatures."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark.errors import BadFileError
from dspark.scheduler.sts import STSResult, apply_sts, load_sts_json, save_sts_json


def test_apply_sts_on_tensors_and_arrays():
    logits = torch.tensor([[2.0, -2.0], [0.0, 4.0]])
    out = apply_sts(logits, [2.0, 4.0])
    assert isinstance(out, torch.Tensor)
    assert torch.allclose(out, torch.sigmoid(torch.tensor([[1.0, -0.5], [0.0, 1.0]])))
    assert np.allclose(apply_sts(logits.numpy(), [2.0, 4.0]), out.numpy())
    with pytest.raises(ValueError, match="temperatures"):
        apply_sts(logits, [1.0, 1.0, 1.0])


# --------------------------------------------------------------------------- STS JSON


def test_sts_json_round_trip_in_sglang_format(tmp_path):
    result = STSResult(temperatures=[1.5, 2.0, 0.5], ece_before=[0.1, 0.2, 0.3], ece_after=[0.01, 0.02, 0.03],
                       num_samples=123)
    path = tmp_path / "sts" / "dspark_sts.json"
    save_sts_json(path, result, dataset="gsm8k")
    payload = json.loads(path.read_text())
    assert list(payload) == ["temperatures", "dataset", "num_samples", "ece_before", "ece_after"]
    assert payload["dataset"] == "gsm8k" and payload["num_samples"] == 123
    assert load_sts_json(path, block_size=3) == [1.5, 2.0, 0.5]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"temperatures": [1.0, 2.0]}', "block size is 3"),
        ('{"temperatures": [1.0, 0.0, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, -1.0, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, NaN, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, true, 2.0]}', "> 0"),
        ('{"temperatures": [1.0, "2", 2.0]}', "> 0"),
        ('{"temps": [1.0, 1.0, 1.0]}', "'temperatures' list"),
        ("[1.0, 1.0, 1.0]", "'temperatures' list"),
        ("{not json", "not valid JSON"),
    ],
)
def test_load_sts_json_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "sts.json"
    path.write_text(content)
    with pytest.raises(BadFileError, match=message) as info:  # a DSparkError: one line from the CLI
        load_sts_json(path, block_size=3)
    assert str(path) in str(info.value)


def test_load_sts_json_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_sts_json(tmp_path / "nope.json", block_size=3)
