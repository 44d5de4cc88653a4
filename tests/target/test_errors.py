"""Errors a user can cause with a target: each gives a DSparkError with a message that says what is wrong.

The CLI turns them into exit code 2 and one ``dspark: error: ...`` line, without a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dspark.cli import main
from dspark.errors import ModelLoadError, PromptError
from dspark.target.model import load_target
from tests.tiny import save_hf_folder, tiny_config, tiny_target


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory) -> Path:
    return save_hf_folder(tmp_path_factory.mktemp("good"), tiny_config())


@pytest.fixture
def folder(good_folder, tmp_path) -> Path:
    """A fresh copy of a valid tiny HF folder, to break."""
    return Path(shutil.copytree(good_folder, tmp_path / "model"))


def _weights(folder: Path) -> Path:
    (path,) = folder.glob("*.safetensors")
    return path


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_valid_folder_loads(folder):
    target = load_target(str(folder), tokenizer=False)  # the fixture itself is sound
    assert target.num_layers == tiny_config()["num_hidden_layers"]


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a preset .* nor an existing folder"):
        load_target(str(tmp_path / "nowhere"), tokenizer=False)


def test_folder_without_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="has no config.json: expected a Hugging Face model folder"):
        load_target(str(folder), tokenizer=False)


@pytest.mark.parametrize(("content", "message"), [
    (b"{\"model_type\": \"llama\", ", "is not valid JSON"),
    (b"\xff\xfe\x00garbage", "is not valid JSON"),
    (b"[1, 2, 3]", "must hold a JSON object"),
])
def test_corrupt_config(folder, content, message):
    (folder / "config.json").write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        load_target(str(folder), tokenizer=False)


def test_config_without_a_required_field(folder):
    _edit_config(folder, hidden_size=None)
    with pytest.raises(ModelLoadError, match="config.json lacks the field 'hidden_size'"):
        load_target(str(folder), tokenizer=False)


def test_config_with_a_malformed_field(folder):
    _edit_config(folder, num_hidden_layers="four")
    with pytest.raises(ModelLoadError, match="config.json has a malformed field"):
        load_target(str(folder), tokenizer=False)


@pytest.mark.parametrize("model_type", ["gpt2", "mixtral", None])
def test_unsupported_model_type(folder, model_type):
    _edit_config(folder, model_type=model_type)
    with pytest.raises(ModelLoadError, match=f"model_type {model_type!r} is not supported; supported families: llama"):
        load_target(str(folder), tokenizer=False)


def test_unsupported_rope_type(folder):
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="unsupported rope_type 'yarn'"):
        load_target(str(folder), tokenizer=False)


def test_corrupt_safetensors(folder):
    _weights(folder).write_bytes(b"this is not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read weights from .*model.safetensors"):
        load_target(str(folder), tokenizer=False)


def test_truncated_safetensors(folder):
    path = _weights(folder)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read weights from"):
        load_target(str(folder), tokenizer=False)


def test_no_weight_files(folder):
    _weights(folder).unlink()
    with pytest.raises(ModelLoadError, match=r"has no \*.safetensors"):
        load_target(str(folder), tokenizer=False)


def test_missing_weight(folder):
    path = _weights(folder)
    state = load_file(path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path)
    with pytest.raises(ModelLoadError, match=r"weights missing .*: \['model.layers.1.mlp.up_proj.weight'\]"):
        load_target(str(folder), tokenizer=False)


def test_weights_of_another_shape(folder):
    _edit_config(folder, intermediate_size=48)
    with pytest.raises(ModelLoadError, match=r"mlp.gate_proj.weight has shape \(64, 32\), expected \(48, 32\)"):
        load_target(str(folder), tokenizer=False)


def test_weights_the_config_does_not_describe(folder):
    """A checkpoint with biases under a config without them is refused, not silently run without them."""
    path = _weights(folder)
    state = load_file(path)
    state["model.layers.0.self_attn.o_proj.bias"] = state["model.norm.weight"].clone()
    save_file(state, path)
    with pytest.raises(ModelLoadError, match="weights this architecture does not use: .*o_proj.bias"):
        load_target(str(folder), tokenizer=False)


def test_missing_tokenizer(folder):
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_target(str(folder))  # a tiny folder has weights but no tokenizer files


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_prompt(text):
    target = tiny_target()
    with pytest.raises(PromptError, match="the prompt is empty"):
        target.encode_chat(text)
    with pytest.raises(PromptError, match="the prompt is empty"):
        target.check_prompt([])


def test_prompt_longer_than_the_context():
    target = tiny_target(max_position_embeddings=32)
    target.check_prompt([5] * 31)  # fits, with one position left to generate into
    with pytest.raises(PromptError, match="the prompt has 32 tokens but the model's context is 32; shorten it"):
        target.check_prompt([5] * 32)


def test_prompt_and_new_tokens_longer_than_the_context():
    target = tiny_target(max_position_embeddings=32)
    target.check_prompt([5] * 20, max_new_tokens=12)
    with pytest.raises(PromptError, match="20 tokens and 13 new tokens .* ask for at most 12 new tokens"):
        target.check_prompt([5] * 20, max_new_tokens=13)


def test_prompt_outside_the_vocabulary():
    target = tiny_target()
    with pytest.raises(PromptError, match=r"token ids \[96, -1\] are outside the vocabulary of 96"):
        target.check_prompt([3, 96, -1])


def _cli_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark: error: "), err
    return lines[0]


def test_cli_reports_a_missing_folder(capsys, tmp_path):
    line = _cli_error(capsys, ["generate", "--target", str(tmp_path / "nowhere"), "--chat", "hi"])
    assert "nor an existing folder" in line


def test_cli_reports_a_corrupt_folder(capsys, folder):
    (folder / "config.json").write_text("{not json")
    line = _cli_error(capsys, ["generate", "--target", str(folder), "--chat", "hi"])
    assert "is not valid JSON" in line


def test_cli_reports_an_unsupported_model(capsys, folder):
    _edit_config(folder, model_type="gpt2")
    line = _cli_error(capsys, ["generate", "--target", str(folder), "--chat", "hi"])
    assert "model_type 'gpt2' is not supported" in line
