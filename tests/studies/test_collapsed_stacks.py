"""scripts/collapsed_stacks.py: shares of a py-spy raw profile (self, inclusive, under a frame), and its refusals."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "collapsed_stacks.py"


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_shares_add_up_by_frame(tmp_path):
    stacks = tmp_path / "stacks.txt"
    stacks.write_text("run (e.py:1);step (e.py:9);matmul (m.py:3) 6\n"
                      "run (e.py:2);step (e.py:9);matmul (m.py:3) 2\n"
                      "run (e.py:2);step (e.py:9);propose (d.py:4);matmul (m.py:3) 2\n")
    done = _run(stacks, "--under", "e.py:1", "--under", "propose", "--title", "Written by `x`.")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("Written by `x`.\n\n10 samples.")
    assert "| `e.py:1` | 60.0 % |" in out and "| `propose` | 20.0 % |" in out
    assert "| 100.0 % | `matmul (m.py:3)` |" in out  # self: every sample ends in matmul
    assert "| 100.0 % | `step (e.py:9)` |" in out  # inclusive, counted once per stack
    assert "| 20.0 % | `propose (d.py:4)` |" in out


def test_a_sample_with_no_python_frame_or_an_odd_frame_name_is_read(tmp_path):
    stacks = tmp_path / "stacks.txt"  # py-spy writes a line with an empty stack for a native-only sample
    stacks.write_bytes(b"run (e.py:1);step (e.py:9) 3\n 1\nrun (e.py:1);odd\r\xc2\x85\xff name (?:0) 4\n")
    done = _run(stacks)  # a junk frame name: a \r, a \x85 (line breaks to Python's text mode) and a byte not UTF-8
    assert done.returncode == 0, done.stderr
    assert "8 samples." in done.stdout and "| 12.5 % | `(no Python frame)` |" in done.stdout


def test_refuses_a_missing_or_malformed_file(tmp_path):
    done = _run(tmp_path / "none.txt")
    assert done.returncode != 0 and "no file" in done.stderr and "Traceback" not in done.stderr
    bad = tmp_path / "bad.txt"
    bad.write_text("run;step many\n")
    done = _run(bad)
    assert done.returncode != 0 and "bad.txt:1" in done.stderr and "Traceback" not in done.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    done = _run(empty)
    assert done.returncode != 0 and "no samples" in done.stderr
