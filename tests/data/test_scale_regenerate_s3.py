"""scripts/scale_regenerate_s3.sh: the stage-3 commands in order, its refusal, and running once (no model needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scale_regenerate_s3.sh"
STUB = """#!{python}
import sys
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
if args[:2] == ["data", "merge"]:  # the merged file: one record per stage-3 prompt
    open(args[args.index("--out") + 1], "w").write('{{"id": "s3-a"}}\\n{{"id": "s3-b"}}\\n')
"""


def _run(tmp_path: Path, answers: int) -> subprocess.CompletedProcess:
    stub = tmp_path / "dspark-stub"
    stub.write_text(STUB.format(python=sys.executable, calls=str(tmp_path / "calls")))
    stub.chmod(0o755)
    r = tmp_path / "r"
    r.mkdir(exist_ok=True)
    (r / "regenerated-R.jsonl").write_text("".join(json.dumps({"id": f"old{i}"}) + "\n" for i in range(answers)))
    (r / "prompts-S3.jsonl").write_text('{"id": "s3-a"}\n{"id": "s3-b"}\n')  # as `data prompts` built it
    slicing = tmp_path / "slices.tsv"
    slicing.write_text("R1\t0\t1\nR4\t1\t3\n")  # stages 1-2 end at line 3
    env = {"PATH": os.environ["PATH"], "R": str(r), "DSPARK": str(stub), "SLICING": str(slicing),
           "PYTHON": sys.executable, "SHARDS": "2"}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)


def test_the_shards_run_then_merge_and_the_answers_go_on_after_stages_1_2(tmp_path):
    done = _run(tmp_path, answers=3)
    assert done.returncode == 0, done.stderr + done.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == f"data fetch-archives {tmp_path}/r/archives"  # the prompt file exists: not rebuilt
    shards = sorted(c for c in calls if "data regenerate" in c)
    assert [c.split("--shard ")[1] for c in shards] == ["0/2", "1/2"]
    assert all("--seed 21" in c and "--max-new-tokens 256" in c and "--dtype bfloat16" in c for c in shards)
    assert calls[-1].startswith("data merge --prompts") and calls[-1].endswith("regenerated-S3.shard1.jsonl")
    lines = (tmp_path / "r" / "regenerated-R.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["old0", "old1", "old2", "s3-a", "s3-b"]


def test_it_runs_once_and_refuses_unfinished_stages(tmp_path):
    short = _run(tmp_path, answers=2)
    assert short.returncode == 2 and "has 2 lines, not stages 1-2's 3" in short.stdout
    assert "data regenerate" not in (tmp_path / "calls").read_text()
    first = _run(tmp_path, answers=3)
    assert first.returncode == 0
    # the stage's answers are in the file now: a second call stops before any work
    (tmp_path / "calls").unlink()
    r = tmp_path / "r"
    full = (r / "regenerated-R.jsonl").read_text()
    env = {"PATH": os.environ["PATH"], "R": str(r), "DSPARK": str(tmp_path / "dspark-stub"),
           "SLICING": str(tmp_path / "slices.tsv"), "PYTHON": sys.executable}
    again = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "already in" in again.stdout
    assert (r / "regenerated-R.jsonl").read_text() == full
    assert "regenerate" not in (tmp_path / "calls").read_text()
