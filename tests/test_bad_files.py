"""Every file a user hands to dspark is checked on load: a corrupt one raises a DSparkError (printed by the CLI
as one ``dspark: error: ...`` line, exit 2) whose message names the file and says what is wrong.

Files: STS JSON, SPS table, draft vocabulary, training config, tokenized-data folder (manifest.json and the
.npy arrays), training state on resume. Each gets corrupt variants (wrong count, negative, unsorted, missing
key, truncated, not JSON, empty); one case runs end to end through ``dspark eval --sts``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.data.tokenized import FORMAT_VERSION, TokenizedDataset
from dspark.drafters.draft_vocab import load_draft_vocab
from dspark.errors import DSparkError
from dspark.scheduler.sps import SPSTable
from dspark.scheduler.step_cost import StepCostModel
from dspark.scheduler.sts import load_sts_json
from dspark.training.checkpoints import load_training_state
from dspark.training.config import load_config

REPO = Path(__file__).resolve().parents[1]


def check(load, path: Path, match: str) -> None:
    """``load()`` raises a DSparkError on one line that names ``path`` and contains ``match``."""
    with pytest.raises(DSparkError) as info:
        load()
    message = str(info.value)
    assert str(path) in message and match in message, message
    assert "\n" not in message, message


# ---------------------------------------------------------------- JSON files

STS_OK = {"temperatures": [1.0, 2.0, 0.5], "dataset": "x", "num_samples": 3}
SPS_OK = {"sample_batch_tokens": [1, 8, 16], "sample_steps_per_sec": [50.0, 40.0, 25.0], "max_batch_tokens": 24}
VOCAB_OK = {"format": "dspark-draft-vocab", "version": 1, "vocab_size": 96, "size": 3, "coverage": 0.5,
            "source": "x", "token_ids": [5, 2, 9]}
CONFIG_OK = {"drafter": "dspark", "lr": 1e-3, "max_steps": 2, "model": {"block_size": 4}}
COST_OK = {"format": "dspark-step-cost", "version": 1, "units": "ms",
           "verify": {"batch_tokens": [8, 16], "ms": [20.0, 25.0], "max_batch_tokens": 16},
           "draft": {"requests": [1, 2], "ms": [1.0, 1.5]}, "host": {"requests": [1, 2], "ms": [0.5, 0.9]},
           "profile": {"threads": 1}}


def text_variants(ok: dict) -> dict[str, str]:
    """The corruptions every JSON file gets: truncated, not JSON, empty, not an object."""
    full = json.dumps(ok)
    return {"truncated": full[: len(full) // 2], "not JSON": "this is not json", "empty": "", "a list": "[1, 2]"}


def edit(ok: dict, **changes) -> str:
    """``ok`` with keys changed (value None: the key removed), as JSON text."""
    out = {k: v for k, v in ok.items() if changes.get(k, 0) is not None}
    out.update({k: v for k, v in changes.items() if v is not None})
    return json.dumps(out)


LOADERS = {
    "sts": lambda path: load_sts_json(path, block_size=3),
    "sps": SPSTable.load,
    "vocab": lambda path: load_draft_vocab(path, 96),
    "config": lambda path: load_config(str(path)),
    "cost": StepCostModel.load,
}
OK = {"sts": STS_OK, "sps": SPS_OK, "vocab": VOCAB_OK, "config": CONFIG_OK, "cost": COST_OK}
CASES = [  # (file kind, variant, content, what the message says)
    ("sts", "wrong count", edit(STS_OK, temperatures=[1.0, 2.0]), "has 2 temperatures"),
    ("sts", "negative", edit(STS_OK, temperatures=[1.0, -2.0, 0.5]), "> 0"),
    ("sts", "missing key", edit(STS_OK, temperatures=None), "'temperatures' list"),
    ("sps", "unsorted", edit(SPS_OK, sample_batch_tokens=[1, 16, 8]), "strictly increasing"),
    ("sps", "negative", edit(SPS_OK, sample_steps_per_sec=[50.0, -40.0, 25.0]), "positive"),
    ("sps", "wrong count", edit(SPS_OK, sample_steps_per_sec=[50.0, 40.0]), "equal length"),
    ("sps", "missing key", edit(SPS_OK, max_batch_tokens=None), "missing ['max_batch_tokens']"),
    ("vocab", "negative", edit(VOCAB_OK, token_ids=[5, -2, 9]), "distinct ids in [0, 96)"),
    ("vocab", "wrong count", edit(VOCAB_OK, vocab_size=100), "vocabulary of 100"),
    ("vocab", "missing key", edit(VOCAB_OK, token_ids=None), "'token_ids'"),
    ("vocab", "not ids", edit(VOCAB_OK, token_ids=["a", 2]), "'token_ids'"),
    ("config", "negative", edit(CONFIG_OK, lr=-1.0), "lr must be > 0"),
    ("config", "unknown key", edit(CONFIG_OK, learning_rate=1.0), "unknown training config key"),
    ("config", "wrong type", edit(CONFIG_OK, max_steps="ten"), "wrong type"),
    ("config", "bad model", edit(CONFIG_OK, model={"block_size": -1}), "block_size must be >= 1"),
    ("cost", "newer version", edit(COST_OK, version=2), "version 2"),
    ("cost", "negative host", edit(COST_OK, host={"requests": [1], "ms": [-1.0]}), ">= 0"),
    ("cost", "unknown key", edit(COST_OK, gpu="h100"), "unknown ['gpu']"),
    ("cost", "bad sps table", json.dumps(SPS_OK | {"sample_batch_tokens": [1, 16, 8]}), "strictly increasing"),
] + [(kind, variant, text, "") for kind in LOADERS for variant, text in text_variants(OK[kind]).items()]


@pytest.mark.parametrize("kind, variant, content, match", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_corrupt_json_file_is_a_one_line_error_naming_it(tmp_path, kind, variant, content, match):
    path = tmp_path / f"{kind}.json"
    path.write_text(content)
    check(lambda: LOADERS[kind](path), path, match)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_the_unbroken_files_load_and_a_missing_one_is_named(tmp_path, kind):
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(OK[kind]))
    LOADERS[kind](path)  # negative control: the variants above break only what they say
    check(lambda: LOADERS[kind](tmp_path / "missing.json"), tmp_path / "missing.json", "")
    check(lambda: LOADERS[kind](tmp_path), tmp_path, "")  # a folder, not a file


# ---------------------------------------------------------------- a tokenized-data folder

def write_folder(path: Path) -> Path:
    """A valid tokenized folder of 3 samples (lengths 4, 3, 5) as `dspark data tokenize` writes it."""
    path.mkdir()
    ids = np.arange(12, dtype=np.int32) + 2
    np.save(path / "input_ids.npy", ids)
    np.save(path / "loss_mask.npy", np.ones(12, dtype=np.uint8))
    np.save(path / "offsets.npy", np.array([0, 4, 7, 12], dtype=np.int64))
    (path / "manifest.json").write_text(json.dumps({"format": "dspark-tokenized", "version": FORMAT_VERSION,
                                                    "num_samples": 3, "num_tokens": 12, "vocab_size": 96}))
    return path


def _manifest(**changes):
    def corrupt(folder: Path) -> Path:
        path = folder / "manifest.json"
        path.write_text(edit(json.loads(path.read_text()), **changes))
        return path
    return corrupt


def _write(name: str, data: bytes | str):
    def corrupt(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path
    return corrupt


def _truncate(name: str):
    def corrupt(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(path.read_bytes()[:-7])
        return path
    return corrupt


def _array(name: str, array: np.ndarray):
    def corrupt(folder: Path) -> Path:
        np.save(folder / name, array)
        return folder / name
    return corrupt


def _remove(name: str):
    def corrupt(folder: Path) -> Path:
        (folder / name).unlink()
        return folder / name
    return corrupt


TOKENIZED = {  # variant: (corrupt the folder, return the file the message must name; what it says)
    "manifest not JSON": (_write("manifest.json", "{nope"), "not valid JSON"),
    "manifest empty": (_write("manifest.json", ""), "not valid JSON"),
    "manifest a list": (_write("manifest.json", "[1]"), "JSON object"),
    "manifest missing key": (_manifest(num_tokens=None), "'num_tokens'"),
    "manifest negative": (_manifest(num_samples=-3), "'num_samples'"),
    "manifest wrong count": (_manifest(num_samples=4), "has 4 entries where"),
    "manifest old version": (_manifest(version=0), "format version 0"),
    "input_ids truncated": (_truncate("input_ids.npy"), "truncated"),
    "input_ids empty": (_write("input_ids.npy", b""), "truncated"),
    "input_ids not npy": (_write("input_ids.npy", "hello"), "truncated"),
    "input_ids wrong count": (_array("input_ids.npy", np.arange(11, dtype=np.int32)), "has 11 entries"),
    "input_ids negative": (_array("input_ids.npy", -np.arange(12, dtype=np.int32)), "token ids outside"),
    "input_ids beyond vocab": (_array("input_ids.npy", np.arange(12, dtype=np.int32) + 90), "token ids outside"),
    "input_ids floats": (_array("input_ids.npy", np.zeros(12)), "integer array"),
    "loss_mask missing": (_remove("loss_mask.npy"), "is missing"),
    "loss_mask truncated": (_truncate("loss_mask.npy"), "truncated"),
    "offsets unsorted": (_array("offsets.npy", np.array([0, 7, 4, 12])), "without decreasing"),
    "offsets negative": (_array("offsets.npy", np.array([-1, 4, 7, 12])), "rise from 0"),
    "offsets wrong total": (_array("offsets.npy", np.array([0, 4, 7, 11])), "num_tokens = 12"),
    "offsets 2-D": (_array("offsets.npy", np.zeros((2, 2), dtype=np.int64)), "1-D"),
}


@pytest.mark.parametrize("variant", sorted(TOKENIZED))
def test_a_corrupt_tokenized_folder_is_a_one_line_error_naming_the_file(tmp_path, variant):
    folder = write_folder(tmp_path / "tok")
    assert [len(TokenizedDataset(folder)[i]["input_ids"]) for i in range(3)] == [4, 3, 5]  # negative control
    corrupt, match = TOKENIZED[variant]
    path = corrupt(folder)
    check(lambda: TokenizedDataset(folder), path, match)


# ---------------------------------------------------------------- a training state

def test_a_corrupt_training_state_is_a_one_line_error_naming_the_file(tmp_path):
    folder = tmp_path / "step_2"
    folder.mkdir()
    path = folder / "training_state.rank0.pt"
    params = [torch.zeros(3, 2), torch.zeros(4)]
    state = {"step": 2, "master_weights": [p.clone() for p in params], "optimizer": {}, "scheduler": {},
             "rng": {}, "tokens_seen": 0.0, "train_seconds": 0.0}
    torch.save(state, path)
    assert load_training_state(folder, 0, params)["step"] == 2  # negative control
    good = path.read_bytes()
    for content, match in [(good[:-100], "truncated or corrupt"), (b"", "truncated or corrupt"),
                           (b"{\"step\": 2}", "truncated or corrupt")]:
        path.write_bytes(content)
        check(lambda: load_training_state(folder, 0, params), path, match)
    for changed, match in [({"optimizer": None}, "lacks optimizer"), ({"step": -1}, "integer >= 0"),
                           ({"master_weights": [torch.zeros(3, 2)]}, "do not fit the model")]:
        torch.save({k: v for k, v in {**state, **changed}.items() if v is not None}, path)
        check(lambda: load_training_state(folder, 0, params), path, match)
    path.unlink()
    check(lambda: load_training_state(folder, 0, params), folder, "not a resumable checkpoint")


# ---------------------------------------------------------------- through the CLI

def dspark(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    return subprocess.run([sys.executable, "-m", "dspark.cli", "--threads", "1", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_eval_with_a_bad_sts_file_exits_2_with_one_line(tmp_path):
    from tests.tiny import save_hf_folder, save_word_tokenizer, tiny_config

    target = save_word_tokenizer(save_hf_folder(tmp_path / "target", tiny_config()), 96)
    bad = tmp_path / "sts.json"
    bad.write_text(json.dumps({"temperatures": [1.0, -2.0]}))
    proc = dspark("eval", "--target", str(target), "--drafter", "pl=prompt-lookup", "--sts", f"pl={bad}",
                  "--datasets", "gsm8k", "--limit", "1", "--out", str(tmp_path / "eval"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark: error: STS file ") and str(bad) in lines[0], lines
    assert not (tmp_path / "eval").exists()  # nothing was decoded


def test_cli_train_with_a_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "cfg.json"
    bad.write_text('{"drafter": "dspark", "lr": ')
    proc = dspark("train", "--config", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"dspark: error: config {bad} is not valid JSON")
