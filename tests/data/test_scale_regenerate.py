"""scripts/scale_regenerate.sh: which engine answers, and its one-line refusals (no model, no vLLM needed)."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scale_regenerate.sh"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    stub = tmp_path / "dspark-stub"  # records the command line it was given
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    stub.chmod(0o755)
    (tmp_path / "r").mkdir(exist_ok=True)
    (tmp_path / "r" / "prompts-R.jsonl").write_text('{"id": "a", "turns": ["hi"]}\n')
    full = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "R": str(tmp_path / "r"), "A": str(tmp_path / "a"),
            "DSPARK": str(stub), "VLLM_VENV": str(tmp_path / "no-vllm"), **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full)


def test_engine_dspark_regenerates_in_process_where_the_last_run_stopped(tmp_path):
    done = _run(tmp_path, ENGINE="dspark", BATCH="8")
    assert done.returncode == 0, done.stderr + done.stdout
    calls = (tmp_path / "calls").read_text().split("\n")[:-1]
    assert len(calls) == 1  # the prompts exist: only the regeneration
    assert calls[0].startswith("--threads 1 data regenerate --prompts") and "--batch-size 8" in calls[0]
    assert f"--out {tmp_path}/r/regenerated-R.jsonl" in calls[0] and "--seed 21" in calls[0]


def test_an_unknown_engine_or_a_missing_vllm_is_refused_in_one_line(tmp_path):
    wrong = _run(tmp_path, ENGINE="sglang")
    assert wrong.returncode == 2 and wrong.stdout.strip() == "ENGINE=sglang: vllm or dspark"
    no_vllm = _run(tmp_path)  # the default engine, and VLLM_VENV holds no vLLM
    assert no_vllm.returncode == 2 and "ENGINE=dspark" in no_vllm.stdout
    assert not (tmp_path / "calls").exists()  # nothing ran
