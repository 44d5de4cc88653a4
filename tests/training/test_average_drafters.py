"""scripts/average_drafters.py: weight interpolation of two drafters of one lineage, and its refusals."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "average_drafters.py"


def _drafter(folder: Path, fc: torch.Tensor, vocab: torch.Tensor, config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    config = config or {"architectures": ["DSparkDraftModel"], "num_hidden_layers": 2}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": fc, "draft_vocab": vocab}, str(folder / "model.safetensors"))
    return folder


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_floats_are_interpolated_in_float32_and_integers_kept(tmp_path):
    vocab = torch.arange(5)
    a = _drafter(tmp_path / "a", torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16), vocab)
    b = _drafter(tmp_path / "b", torch.tensor([[3.0, 2.0], [-3.0, 8.0]], dtype=torch.bfloat16), vocab)
    done = _run(a, b, "--weight", "0.25", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "1 tensors interpolated at w = 0.25, 1 integer tensors kept" in done.stdout
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out["fc.weight"].dtype == torch.bfloat16  # A's dtype
    assert torch.equal(out["fc.weight"].float(), torch.tensor([[1.5, 2.0], [1.5, 5.0]]))  # 0.75 A + 0.25 B
    assert torch.equal(out["draft_vocab"], vocab)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((a / "config.json").read_text())
    ends = _run(a, b, "--weight", "1", "--out", tmp_path / "end")  # w = 1 is B itself
    assert ends.returncode == 0
    assert torch.equal(load_file(tmp_path / "end" / "model.safetensors")["fc.weight"],
                       load_file(b / "model.safetensors")["fc.weight"])


def test_drafters_that_are_not_twins_are_refused_in_one_line(tmp_path):
    fc = torch.ones(2, 2)
    a = _drafter(tmp_path / "a", fc, torch.arange(5))
    other_vocab = _drafter(tmp_path / "v", fc, torch.arange(1, 6))
    other_config = _drafter(tmp_path / "c", fc, torch.arange(5), {"architectures": ["X"], "num_hidden_layers": 3})
    other_shape = _drafter(tmp_path / "s", torch.ones(3, 2), torch.arange(5))
    for b, message in ((other_vocab, "draft_vocab: "), (other_config, "configs differ in architectures, "
                       "num_hidden_layers"), (other_shape, "fc.weight: shape (2, 2)"),
                       (tmp_path / "missing", "no config.json")):
        done = _run(a, b, "--out", tmp_path / "out")
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    bad = _run(a, a, "--weight", "1.5", "--out", tmp_path / "out")
    assert bad.returncode == 2 and "--weight must lie in [0, 1], got 1.5" in bad.stderr
    assert not (tmp_path / "out").exists()  # nothing written by a refused call
