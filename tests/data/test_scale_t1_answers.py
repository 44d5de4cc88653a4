"""scripts/scale_t1_answers.sh: a committed slice's prompts answered again at temperature 1, then tokenized and
cached as slice T1<SLICE>; NUM, resuming, and the refusals (no model needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scale_t1_answers.sh"
STUB = """#!{python}
import os, sys
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
def out():
    return args[args.index("--out") + 1]
if "merge" in args:
    open(out(), "w").write('{{"id": "t1"}}\\n')
if "tokenize" in args or "features" in args:
    os.makedirs(out(), exist_ok=True)
    open(os.path.join(out(), "manifest.json"), "w").write("{{}}")
"""


def _run(tmp_path: Path, answers: int = 6, **extra: str) -> subprocess.CompletedProcess:
    stub = tmp_path / "dspark-stub"
    stub.write_text(STUB.format(python=sys.executable, calls=str(tmp_path / "calls")))
    stub.chmod(0o755)
    r = tmp_path / "r"
    r.mkdir(exist_ok=True)
    if not (r / "regenerated-R.jsonl").exists():
        (r / "regenerated-R.jsonl").write_text("".join(json.dumps({"id": f"a{i}"}) + "\n" for i in range(answers)))
    slicing = tmp_path / "slices.tsv"
    slicing.write_text("R1\t0\t2\nR4\t2\t6\n")
    env = {"PATH": os.environ["PATH"], "R": str(r), "DSPARK": str(stub), "TORCHRUN": str(stub),
           "SLICING": str(slicing), "SHARDS": "2", "PROCS": "2", **extra}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)


def test_the_slices_prompts_are_answered_at_temperature_1_then_cached(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    r = tmp_path / "r"
    prompts = [json.loads(x)["id"] for x in (r / "prompts-T1R4.jsonl").read_text().splitlines()]
    assert prompts == ["a2", "a3", "a4", "a5"]  # lines 2-6: slice R4 of the committed slicing
    calls = (tmp_path / "calls").read_text().splitlines()
    shards = sorted(c for c in calls if "data regenerate" in c)
    assert [c.split("--shard ")[1] for c in shards] == ["0/2", "1/2"]
    assert all("--temperature 1 --top-p 1 --top-k 0" in c and "--seed 21" in c and "--max-new-tokens 256" in c
               for c in shards)
    assert any(c.startswith("data merge") and c.endswith("regen-T1R4.shard1.jsonl") for c in calls)
    assert any("data tokenize" in c and f"--out {r}/tok-T1R4" in c for c in calls)
    [features] = [c for c in calls if "data features" in c]
    assert features.startswith("--nproc_per_node 2 -m dspark.cli") and f"--out {r}/features-T1R4" in features
    assert (r / "regen-T1R4.jsonl").read_text() == '{"id": "t1"}\n'
    # a second call finds everything built and runs nothing
    (tmp_path / "calls").unlink()
    again = _run(tmp_path)
    assert again.returncode == 0 and "(built)" in again.stdout and not (tmp_path / "calls").exists()


def test_num_takes_the_first_prompts_and_a_changed_num_is_refused(tmp_path):
    done = _run(tmp_path, NUM="3")
    assert done.returncode == 0, done.stderr + done.stdout
    prompts = (tmp_path / "r" / "prompts-T1R4.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in prompts] == ["a2", "a3", "a4"]
    other = _run(tmp_path, NUM="2")
    assert other.returncode == 2 and "has 3 prompts, not 2" in other.stdout


def test_a_slice_not_in_the_slicing_or_not_answered_yet_is_refused(tmp_path):
    missing = _run(tmp_path, SLICE="R7")
    assert missing.returncode == 2 and "no slice R7 in" in missing.stdout
    (tmp_path / "short").mkdir()
    short = _run(tmp_path / "short", answers=4)
    assert short.returncode == 2 and "slice R4 ends at line 6" in short.stdout and "has 4" in short.stdout
