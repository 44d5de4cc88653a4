"""The test tiers: conftest.py marks real-model and subprocess tests (`make test-fast` leaves them out), and in CI
(CI=true) a test that needs SmolLM2 fails instead of skipping when SmolLM2 cannot be prepared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import subprocess

import pytest

from dspark.errors import ModelLoadError
from tests import tiny


def test_needs_the_tokenizer(monkeypatch):
    import dspark.target.convert as convert

    def missing(name):
        raise ModelLoadError("not prepared here")

    monkeypatch.setattr(convert, "resolve_model_path", missing)
    tiny.smollm2_tokenizer()


def test_skips_for_smollm2_elsewhere():
    pytest.skip("SmolLM2 unavailable: written by hand")


def test_skips_for_another_reason():
    pytest.skip("needs something else")


def _start():
    return subprocess.run(["true"])


def test_starts_a_process():
    _start()


def test_loads_the_real_model():
    from dspark.target.model import load_target
    if False:
        load_target("smollm2-135m")
'''


def _pytest(tmp_path: Path, tests: list[str], *args: str, ci: bool) -> subprocess.CompletedProcess:
    """Run the probe's ``tests`` (by name) with this suite's conftest.py, with or without CI=true."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "tests.conftest", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
                           *args, *(f"{probe}::{name}" for name in tests)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_smollm2_skips_fail_in_ci_and_skip_elsewhere(tmp_path):
    skipping = ["test_needs_the_tokenizer", "test_skips_for_smollm2_elsewhere", "test_skips_for_another_reason"]
    local = _pytest(tmp_path, skipping, ci=False)
    assert "3 skipped" in local.stdout, local.stdout + local.stderr
    ci = _pytest(tmp_path, skipping, ci=True)
    assert "2 failed, 1 skipped" in ci.stdout, ci.stdout + ci.stderr  # negative control: the other skip stays one
    assert "FAILED test_probe.py::test_needs_the_tokenizer" in ci.stdout and "run `dspark prepare`" in ci.stdout
    assert "FAILED test_probe.py::test_skips_for_smollm2_elsewhere" in ci.stdout and "needs something else" in ci.stdout


def test_real_model_and_subprocess_tests_are_marked(tmp_path):
    three = ["test_starts_a_process", "test_loads_the_real_model", "test_skips_for_another_reason"]
    fast = _pytest(tmp_path, three, "-m", "not real_model and not subprocess", ci=False)
    assert "1 skipped, 2 deselected" in fast.stdout, fast.stdout + fast.stderr
    marked = _pytest(tmp_path, three, "-m", "subprocess", ci=False)
    assert "1 passed" in marked.stdout and "test_starts_a_process" in marked.stdout, marked.stdout
    marked = _pytest(tmp_path, three, "-m", "real_model", ci=False)
    assert "1 passed" in marked.stdout and "test_loads_the_real_model" in marked.stdout, marked.stdout


def test_every_heavy_entry_names_a_test_that_exists():
    """A renamed test must not fall out of HEAVY silently (it would then slow `make test-fast` down)."""
    import ast

    from tests.conftest import HEAVY

    for node in HEAVY:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), node
        if name:
            tree = ast.parse((ROOT / path).read_text())
            assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, node
