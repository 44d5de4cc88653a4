"""scripts/scale_regenerate_archives.sh: stages 3-8, their commands in order, the refusal, and running once (no
model needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scale_regenerate_archives.sh"
STUB = """#!{python}
import sys
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
if args[:2] == ["data", "merge"]:  # the merged file: one record per prompt of the stage
    open(args[args.index("--out") + 1], "w").write('{{"id": "new-a"}}\\n{{"id": "new-b"}}\\n')
if args[:2] == ["data", "prompts"] or "self-prompts" in args:
    open(args[args.index("--out") + 1], "w").write('{{"id": "new-a"}}\\n{{"id": "new-b"}}\\n')
"""


def _run(tmp_path: Path, answers: int, stage: int = 3, prompts_built: bool = True,
         stage_3_sliced: bool = True) -> subprocess.CompletedProcess:
    stub = tmp_path / "dspark-stub"
    stub.write_text(STUB.format(python=sys.executable, calls=str(tmp_path / "calls")))
    stub.chmod(0o755)
    r = tmp_path / "r"
    r.mkdir(exist_ok=True)
    (r / "regenerated-R.jsonl").write_text("".join(json.dumps({"id": f"old{i}"}) + "\n" for i in range(answers)))
    if prompts_built:
        (r / f"prompts-S{stage}.jsonl").write_text('{"id": "new-a"}\n{"id": "new-b"}\n')  # as `data prompts` built it
    slicing = tmp_path / "slices.tsv"
    # stages 1-2 end at line 3 (R4); stage 3 at line 5 (R5), stage 4 at line 7 (R6), stage 5 at line 9 (R7), stage 6 at line 11 (R8)
    slicing.write_text("R1\t0\t1\nR4\t1\t3\n" + ("R5\t3\t5\n" if stage >= 4 and stage_3_sliced else "")
                       + ("R6\t5\t7\n" if stage >= 5 else "") + ("R7\t7\t9\n" if stage >= 6 else "")
                       + ("R8\t9\t11\n" if stage >= 7 else "") + ("R9\t11\t13\n" if stage >= 8 else ""))
    env = {"PATH": os.environ["PATH"], "R": str(r), "DSPARK": str(stub), "SLICING": str(slicing),
           "PYTHON": sys.executable, "SHARDS": "2", "STAGE": str(stage)}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)


def test_the_shards_run_then_merge_and_the_answers_go_on_after_stages_1_2(tmp_path):
    done = _run(tmp_path, answers=3)
    assert done.returncode == 0, done.stderr + done.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == f"data fetch-archives {tmp_path}/r/archives"  # the prompt file exists: not rebuilt
    shards = sorted(c for c in calls if "data regenerate" in c)
    assert [c.split("--shard ")[1] for c in shards] == ["0/2", "1/2"]
    assert all("--seed 21" in c and "--max-new-tokens 256" in c and "--dtype bfloat16" in c for c in shards)
    assert all("--temperature 0.7 --top-p 0.8 --top-k 20" in c for c in shards)  # DeepSpec's sampling
    assert calls[-1].startswith("data merge --prompts") and calls[-1].endswith("regenerated-S3.shard1.jsonl")
    lines = (tmp_path / "r" / "regenerated-R.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["old0", "old1", "old2", "new-a", "new-b"]


def test_it_runs_once_and_refuses_unfinished_stages(tmp_path):
    short = _run(tmp_path, answers=2)
    assert short.returncode == 2 and "has 2 lines, not the 3 that end slice R4" in short.stdout
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


def test_stage_4_goes_on_after_stage_3_and_excludes_its_prompts(tmp_path):
    done = _run(tmp_path, answers=5, stage=4, prompts_built=False)
    assert done.returncode == 0, done.stderr + done.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    [prompts] = [c for c in calls if c.startswith("data prompts")]
    assert f"--out {tmp_path}/r/prompts-S4.jsonl" in prompts and "--seed 41" in prompts
    assert prompts.endswith(f"--exclude {tmp_path}/r/prompts-S3.jsonl")
    assert "search_questions=1.5" in prompts and "gsm_symbolic=0" in prompts
    assert all("regenerated-S4.shard" in c for c in calls if "data regenerate" in c)
    lines = (tmp_path / "r" / "regenerated-R.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines][5:] == ["new-a", "new-b"]


def test_stage_3_turns_the_later_sources_off_and_a_bad_stage_is_refused(tmp_path):
    done = _run(tmp_path, answers=3, prompts_built=False)
    assert done.returncode == 0, done.stderr + done.stdout
    [prompts] = [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("data prompts")]
    assert "search_questions=0,summaries=0,word_problems=0,open_questions=0" in prompts and "--exclude" not in prompts
    early = _run(tmp_path, answers=5, stage=4, stage_3_sliced=False)
    assert early.returncode == 2 and "no slice R5" in early.stdout and "run stage 3 first" in early.stdout
    bad = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "STAGE": "9"})
    assert bad.returncode == 2 and "STAGE must be 3, 4, 5, 6, 7 or 8, not 9" in bad.stdout


def test_stage_5_has_the_target_write_its_prompts_and_excludes_stages_3_4(tmp_path):
    done = _run(tmp_path, answers=7, stage=5, prompts_built=False)
    assert done.returncode == 0, done.stderr + done.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert not any("fetch-archives" in c or c.startswith("data prompts") for c in calls)
    [prompts] = [c for c in calls if "data self-prompts" in c]
    assert prompts.startswith("--threads 2 data self-prompts") and "--seed 51" in prompts
    assert f"--out {tmp_path}/r/prompts-S5.jsonl" in prompts and "--dtype bfloat16" in prompts
    assert prompts.endswith(f"--exclude {tmp_path}/r/prompts-S3.jsonl {tmp_path}/r/prompts-S4.jsonl")
    assert all("regenerated-S5.shard" in c for c in calls if "data regenerate" in c)
    lines = (tmp_path / "r" / "regenerated-R.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines][7:] == ["new-a", "new-b"]
    (tmp_path / "early").mkdir()  # a machine where stage 4 has not been appended
    early = _run(tmp_path / "early", answers=5, stage=5)
    assert early.returncode == 2 and "not the 7 that end slice R6" in early.stdout


def test_stage_6_writes_more_prompts_with_its_own_seed_and_excludes_stages_3_5(tmp_path):
    done = _run(tmp_path, answers=9, stage=6, prompts_built=False)
    assert done.returncode == 0, done.stderr + done.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    [prompts] = [c for c in calls if "data self-prompts" in c]
    assert "--seed 61" in prompts and f"--out {tmp_path}/r/prompts-S6.jsonl" in prompts
    r = tmp_path / "r"
    assert prompts.endswith(f"--exclude {r}/prompts-S3.jsonl {r}/prompts-S4.jsonl {r}/prompts-S5.jsonl")
    lines = (r / "regenerated-R.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines][9:] == ["new-a", "new-b"]
    (tmp_path / "early").mkdir()  # stage 5 not appended yet
    early = _run(tmp_path / "early", answers=7, stage=6)
    assert early.returncode == 2 and "not the 9 that end slice R7" in early.stdout


def test_stage_7_leans_to_chat_and_excludes_stages_3_6(tmp_path):
    done = _run(tmp_path, answers=11, stage=7, prompts_built=False)
    assert done.returncode == 0, done.stderr + done.stdout
    [prompts] = [c for c in (tmp_path / "calls").read_text().splitlines() if "data self-prompts" in c]
    assert "--seed 71" in prompts and "--mix math=0.3,code=0.2,chat=0.5" in prompts
    r = tmp_path / "r"
    assert prompts.endswith(" ".join(f"{r}/prompts-S{k}.jsonl" for k in (3, 4, 5, 6)))
    lines = (r / "regenerated-R.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines][11:] == ["new-a", "new-b"]


def test_stage_8_answers_by_plain_sampling_at_temperature_1(tmp_path):
    done = _run(tmp_path, answers=13, stage=8, prompts_built=False)
    assert done.returncode == 0, done.stderr + done.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    [prompts] = [c for c in calls if "data self-prompts" in c]
    assert "--seed 81" in prompts and "--mix math=0.35,code=0.25,chat=0.4" in prompts
    r = tmp_path / "r"
    assert prompts.endswith(" ".join(f"{r}/prompts-S{k}.jsonl" for k in (3, 4, 5, 6, 7)))
    shards = [c for c in calls if "data regenerate" in c]
    assert len(shards) == 2 and all("--temperature 1 --top-p 1 --top-k 0" in c for c in shards)
    assert all("--top-p 0.8" not in c for c in shards)
    lines = (r / "regenerated-R.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines][13:] == ["new-a", "new-b"]
