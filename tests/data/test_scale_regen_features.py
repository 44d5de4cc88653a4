"""scripts/scale_regen_features.sh: where the slices of the answers end (no model needed: a stub `dspark`)."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scale_regen_features.sh"


def _run(tmp_path: Path, lines: int, slicing: str | None, *args: str, **extra: str) -> subprocess.CompletedProcess:
    stub = tmp_path / "dspark-stub"  # writes the manifest of whatever --out it is given, records its calls
    stub.write_text('#!/bin/sh\necho "$@" >> ' + f"{tmp_path}/calls\n"
                    'while [ $# -gt 0 ]; do [ "$1" = --out ] && mkdir -p "$2" && touch "$2/manifest.json"; shift; done\n')
    stub.chmod(0o755)
    r = tmp_path / "r"
    r.mkdir(exist_ok=True)
    (r / "regenerated-R.jsonl").write_text("".join(f'{{"id": "{i}"}}\n' for i in range(lines)))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "R": str(r), "DSPARK": str(stub),
           "SLICING": str(tmp_path / "slicing.tsv"), **extra}
    if slicing is not None:
        (tmp_path / "slicing.tsv").write_text(slicing)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env)


def test_a_fresh_machine_rebuilds_the_committed_slicing_then_slices_what_is_new(tmp_path):
    done = _run(tmp_path, 7, "R1\t0\t3\nR2\t3\t5\n", "all")
    assert done.returncode == 0, done.stderr + done.stdout
    r = tmp_path / "r"
    assert (r / "regen-slices.tsv").read_text() == "R1\t0\t3\nR2\t3\t5\nR3\t5\t7\n"
    assert [len((r / f"regen-R{i}.jsonl").read_text().splitlines()) for i in (1, 2, 3)] == [3, 2, 2]
    assert (r / "regen-R2.jsonl").read_text().startswith('{"id": "3"}')
    assert all((r / f"features-R{i}" / "manifest.json").exists() for i in (1, 2, 3))
    again = _run(tmp_path, 7, "R1\t0\t3\nR2\t3\t5\n")  # nothing new: no slice, no call
    assert again.returncode == 0 and "no new records" in again.stdout
    assert len((tmp_path / "calls").read_text().splitlines()) == 6  # tokenize + features per slice


def test_without_a_committed_slicing_one_call_makes_one_slice_of_everything_new(tmp_path):
    done = _run(tmp_path, 4, None)
    assert done.returncode == 0, done.stderr + done.stdout
    assert (tmp_path / "r" / "regen-slices.tsv").read_text() == "R1\t0\t4\n"


def test_a_committed_row_that_does_not_start_where_the_last_slice_ended_is_not_followed(tmp_path):
    done = _run(tmp_path, 6, "R1\t1\t3\n")  # another slicing of other answers: ignored
    assert done.returncode == 0, done.stderr + done.stdout
    assert (tmp_path / "r" / "regen-slices.tsv").read_text() == "R1\t0\t6\n"


def test_one_committed_slice_out_of_order_then_the_next_new_one_after_it(tmp_path):
    slicing = "R1\t0\t3\nR2\t3\t5\nR3\t5\t7\n"
    assert _run(tmp_path, 8, slicing).returncode == 0  # R1
    r = tmp_path / "r"
    done = _run(tmp_path, 8, slicing, "all", SLICE="R3")  # "all" does not repeat a SLICE
    assert done.returncode == 0, done.stderr + done.stdout
    assert (r / "regen-slices.tsv").read_text() == "R1\t0\t3\nR3\t5\t7\n"
    assert (r / "regen-R3.jsonl").read_text().startswith('{"id": "5"}')
    assert (r / "features-R3" / "manifest.json").exists() and not (r / "regen-R2.jsonl").exists()
    assert _run(tmp_path, 8, slicing, SLICE="R3").returncode == 0  # again: listed once
    assert (r / "regen-slices.tsv").read_text().count("R3") == 1
    after = _run(tmp_path, 8, slicing)  # what is new after the last listed slice, under the next free name
    assert after.returncode == 0 and (r / "regen-slices.tsv").read_text().endswith("R4\t7\t8\n")
    missing = _run(tmp_path, 8, slicing, SLICE="R9")
    assert missing.returncode == 2 and "no slice R9" in missing.stdout

