"""`dspark demo` end to end on a tiny target with SmolLM2's tokenizer: reuse path, fast settings, lossless rows."""

from __future__ import annotations

import json

import pytest

from dspark.cli import main
from dspark.drafters.dspark.drafter import save_dspark_checkpoint
from dspark.target.model import cpu_has_bf16_matmul, load_target
from dspark.data.tokenized import write_tokenized
from tests.drafters.tiny_drafters import tiny_dspark
from tests.tiny import save_chat_target


@pytest.fixture(scope="module")
def demo_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    target_dir, tokenizer = save_chat_target(root / "target")
    rows = [{"id": f"s{i}", "status": "success", "conversations": [
        {"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"It is {2 * i}. " * 3}]}
        for i in range(4)]
    (root / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_tokenized(root / "r.jsonl", tokenizer, root / "tok", 64, min_loss_tokens=1, progress=False)
    ckpt = root / "drafter"
    save_dspark_checkpoint(tiny_dspark(load_target(str(target_dir))), ckpt)
    (ckpt / "train_config.json").write_text(json.dumps({"data": [str(root / "tok")]}))
    return target_dir, ckpt, root


def test_demo_reuses_a_drafter_with_its_own_draft_vocabulary(demo_setup, capsys):
    target_dir, ckpt, root = demo_setup
    rc = main(["demo", "--target", str(target_dir), "--drafter", str(ckpt), "--work-dir", str(root / "work"),
               "--prompts-per-set", "1", "--max-new-tokens", "6", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "bfloat16; DSpark head over the top 64 tokens, draft vocabulary of 4096 tokens" in out
    vocab = json.loads((root / "work" / "draft-vocab.json").read_text())
    assert vocab["source"] == str(root / "tok") and vocab["size"] == 4096
    table = [line for line in out.splitlines() if line.startswith("| ") and "decoding" not in line]
    assert len(table) == 4 and all(line.rstrip().endswith("| yes |") for line in table), out
    assert "| hybrid (prompt lookup on repeats, else DSpark) |" in out


def test_demo_can_be_told_to_use_the_exact_settings(demo_setup, capsys):
    target_dir, ckpt, root = demo_setup
    assert main(["demo", "--target", str(target_dir), "--drafter", str(ckpt), "--work-dir", str(root / "w2"),
                 "--prompts-per-set", "1", "--max-new-tokens", "4", "--dtype", "float32", "--head-top-m", "0",
                 "--draft-vocab-size", "0"]) == 0
    assert "float32; DSpark head over all tokens, draft vocabulary of all tokens" in capsys.readouterr().out


def test_demo_takes_the_shipped_reference_drafter_by_default(demo_setup, capsys, monkeypatch, tmp_path):
    """Without --drafter the demo decodes with checkpoints/smollm2-135m-dspark of the repository it runs in,
    in bfloat16 where the CPU multiplies it natively (else float32), and every row equals plain decoding exactly."""
    import shutil

    target_dir, ckpt, root = demo_setup
    shutil.copytree(ckpt, tmp_path / "checkpoints" / "smollm2-135m-dspark")
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--target", str(target_dir), "--work-dir", str(root / "w3"), "--prompts-per-set", "1",
                 "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert f"DSpark drafter: {tmp_path / 'checkpoints' / 'smollm2-135m-dspark'}" in out
    dtype = "bfloat16" if cpu_has_bf16_matmul() else "float32"
    assert f"{dtype}; DSpark head over the top 64 tokens" in out
    table = [line for line in out.splitlines() if line.startswith("| ") and "decoding" not in line]
    assert len(table) == 4 and all(line.rstrip().endswith("| yes |") for line in table), out


def test_the_demo_falls_back_to_float32_where_bf16_cannot_be_made_exact(demo_setup, capsys, monkeypatch):
    import dspark.target.model as target_model

    target_dir, ckpt, root = demo_setup
    monkeypatch.setattr(target_model, "cpu_has_bf16_matmul", lambda: True)
    monkeypatch.setattr(target_model.TargetModel, "batch_invariance_holds", lambda self, *a, **k: False)
    assert main(["demo", "--target", str(target_dir), "--drafter", str(ckpt), "--work-dir", str(root / "w4"),
                 "--prompts-per-set", "1", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "bfloat16 is not batch-invariant on this CPU; decoding in float32 instead" in captured.out
    assert "float32; DSpark head over" in captured.out
    assert "warning: on this CPU a bfloat16 one-token step" in captured.err  # load_target said why


def test_the_demo_schedules_verification_on_a_profiled_step_unless_told_to_verify_everything(demo_setup, capsys):
    """By default the DSpark and hybrid rows verify as Algorithm 1 plans on the step's cost profiled at the start;
    ``--policy all`` verifies every draft; every row stays the plain text either way; a bad policy is one line."""
    target_dir, ckpt, root = demo_setup
    common = ["demo", "--target", str(target_dir), "--drafter", str(ckpt), "--work-dir", str(root / "w5"),
              "--prompts-per-set", "1", "--max-new-tokens", "6"]
    for policy, says in ((None, "verify as alg1 plans"), ("fixed:2", "verify as fixed:2 plans"),
                         ("all", "verify every draft")):
        assert main(common + ([] if policy is None else ["--policy", policy])) == 0
        out = capsys.readouterr().out
        assert f"the DSpark and hybrid rows {says}" in out, out
        assert ("the step's cost profiled at 1 request(s) for alg1" in out) == (policy is None), out
        table = [line for line in out.splitlines() if line.startswith("| ") and "decoding" not in line]
        assert len(table) == 4 and all(line.rstrip().endswith("| yes |") for line in table), out
    assert main(common + ["--policy", "fastest"]) != 0
    err = capsys.readouterr().err
    assert "unknown policy 'fastest'" in err and "Traceback" not in err
