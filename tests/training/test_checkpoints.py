"""Checkpoints that cannot be lost: pruning, resume with a missing or dangling step_latest, refusing to
overwrite, a bad training state, and a run killed with SIGKILL while it writes a checkpoint.

Run as a script (``python -m tests.training.test_checkpoints OUT KILL_POINT``) it is the child process the
kill tests start: a tiny training run that kills itself at KILL_POINT while writing ``step_4``.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.training.config import TrainConfigError
import torch

from dspark.errors import BadFileError, DSparkError
from dspark.training.checkpoints import (
    LATEST,
    checkpoint_folders,
    latest_checkpoint,
    load_training_state,
    prune_checkpoints,
    resume_checkpoint,
)
from dspark.training.trainer import train
from tests.tiny import tiny_target
from tests.training.test_trainer import random_data, read_metrics, tiny_cfg

REPO = Path(__file__).resolve().parents[2]
#: the run every test here uses: checkpoints at steps 2, 4, 6; only the newest kept
RUN = dict(max_steps=6, checkpoint_every=2, keep_checkpoints=1)


def run_cfg(out: Path, **kw):
    return tiny_cfg(out, **{**RUN, **kw})


def final_weights(out: Path, step: int = 6) -> list[torch.Tensor]:
    return torch.load(out / f"step_{step}" / "training_state.rank0.pt", weights_only=True)["master_weights"]


def assert_same_run(a: Path, b: Path, steps=(5, 6)) -> None:
    """``b`` ended bit-exactly where the uninterrupted run ``a`` did."""
    for wa, wb in zip(final_weights(a), final_weights(b), strict=True):
        assert torch.equal(wa, wb)
    ma, mb = read_metrics(a), read_metrics(b)
    assert sorted(mb) == list(range(1, 7))
    for step in steps:
        assert mb[step]["loss"] == ma[step]["loss"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    train(run_cfg(out), target=tiny_target(), dataset=random_data(6))
    return out


def make_folders(out: Path, steps: list[int]) -> None:
    for n in steps:
        (out / f"step_{n}").mkdir(parents=True)
        (out / f"step_{n}" / "training_state.rank0.pt").write_bytes(b"x")


# ---------------------------------------------------------------- pruning

def test_prune_keeps_the_step_just_written_and_ignores_later_numbers(tmp_path):
    make_folders(tmp_path, [1, 2, 3, 10])
    prune_checkpoints(tmp_path, keep=2, step=3)
    assert [n for n, _ in checkpoint_folders(tmp_path)] == [2, 3, 10]
    prune_checkpoints(tmp_path, keep=1, step=3)
    assert [n for n, _ in checkpoint_folders(tmp_path)] == [3, 10]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half-deleted left


def test_a_stale_higher_numbered_checkpoint_does_not_make_the_run_delete_its_own(tmp_path):
    out = tmp_path / "run"
    target, data = tiny_target(), random_data(6)
    train(run_cfg(out, max_steps=2), target=target, dataset=data)
    shutil.copytree(out / "step_2", out / "step_10")  # e.g. left by an earlier, longer run
    last = train(run_cfg(out, max_steps=4), resume=True, target=target, dataset=data)
    assert last == out / "step_4" and last.is_dir()  # the printed "last checkpoint" exists
    assert latest_checkpoint(out) == last.resolve()  # step_latest does not dangle
    assert [n for n, _ in checkpoint_folders(out)] == [4, 10]  # step_2 pruned, the stale one left alone


# ---------------------------------------------------------------- resume and refusing to overwrite

def test_resume_with_a_dangling_step_latest_continues_from_the_newest_complete_checkpoint(tmp_path, uninterrupted):
    out = tmp_path / "run"
    target, data = tiny_target(), random_data(6)
    train(run_cfg(out, keep_checkpoints=0), target=target, dataset=data)
    for step in (4, 6):
        shutil.rmtree(out / f"step_{step}")
    assert (out / LATEST).is_symlink() and latest_checkpoint(out) is None  # dangling
    assert resume_checkpoint(out) == out / "step_2"
    train(run_cfg(out), resume=True, target=target, dataset=data)
    assert_same_run(uninterrupted, out, steps=(3, 4, 5, 6))


def test_resume_without_step_latest_takes_the_newest_step(tmp_path, uninterrupted):
    out = tmp_path / "run"
    target, data = tiny_target(), random_data(6)
    train(run_cfg(out, keep_checkpoints=0), target=target, dataset=data)
    shutil.rmtree(out / "step_6")
    (out / LATEST).unlink()
    assert resume_checkpoint(out) == out / "step_4"
    train(run_cfg(out), resume=True, target=target, dataset=data)
    assert_same_run(uninterrupted, out)


def test_resume_with_no_complete_checkpoint_is_a_clear_error_and_an_empty_folder_starts_at_zero(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert resume_checkpoint(out) is None and resume_checkpoint(tmp_path / "nowhere") is None
    os.symlink("step_4", out / LATEST)
    with pytest.raises(DSparkError, match="no complete checkpoint.*--overwrite"):
        resume_checkpoint(out)
    (out / "step_2").mkdir()  # a step_N without a training state
    with pytest.raises(DSparkError, match="no complete checkpoint"):
        train(run_cfg(out), resume=True, target=tiny_target(), dataset=random_data(6))


def test_a_new_run_refuses_a_folder_with_checkpoints_unless_told(tmp_path):
    out = tmp_path / "run"
    target, data = tiny_target(), random_data(6)
    train(run_cfg(out, max_steps=2), target=target, dataset=data)
    (out / LATEST).unlink()  # step_2 alone, no step_latest: still refused
    shutil.copytree(out / "step_2", out / "step_10")
    with pytest.raises(DSparkError, match="already holds checkpoints \\(step_2, step_10\\).*--overwrite"):
        train(run_cfg(out, max_steps=2), target=target, dataset=data)
    assert [n for n, _ in checkpoint_folders(out)] == [2, 10]  # untouched
    with pytest.raises(DSparkError, match="pass one"):
        train(run_cfg(out, max_steps=2), resume=True, overwrite=True, target=target, dataset=data)
    last = train(run_cfg(out, max_steps=2), overwrite=True, target=target, dataset=data)
    assert [n for n, _ in checkpoint_folders(out)] == [2] and latest_checkpoint(out) == last.resolve()
    assert sorted(read_metrics(out)) == [1, 2]


def test_train_cli_overwrite_and_resume_exclude_each_other(capsys):
    from dspark.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--config", "smollm2-dspark-markov", "--resume", "--overwrite"])
    assert "not allowed with" in capsys.readouterr().err


# ---------------------------------------------------------------- a bad training state

def test_a_truncated_or_mismatched_training_state_is_a_one_line_error(tmp_path):
    out = tmp_path / "run"
    target, data = tiny_target(), random_data(6)
    train(run_cfg(out, max_steps=2), target=target, dataset=data)
    state_file = out / "step_2" / "training_state.rank0.pt"
    good = state_file.read_bytes()
    state_file.write_bytes(good[: len(good) // 2])
    with pytest.raises(BadFileError, match="truncated or corrupt") as info:
        train(run_cfg(out), resume=True, target=target, dataset=data)
    assert str(state_file) in str(info.value) and "\n" not in str(info.value)
    state_file.write_bytes(good)
    other = run_cfg(out, model={"block_size": 4, "num_anchors": 8, "markov_rank": 8})  # another drafter config
    with pytest.raises(TrainConfigError, match="'markov_rank': 16} there") as info:  # read off train_config.json
        train(other, resume=True, target=target, dataset=data)
    assert "\n" not in str(info.value)
    (out / "step_2" / "train_config.json").unlink()  # without it the weights' shapes still tell
    with pytest.raises(BadFileError, match="do not fit the model"):
        train(other, resume=True, target=target, dataset=data)
    state = torch.load(state_file, weights_only=True)
    del state["optimizer"]
    torch.save(state, state_file)
    with pytest.raises(BadFileError, match="lacks optimizer"):
        load_training_state(out / "step_2", 0)


# ---------------------------------------------------------------- kill -9 while writing a checkpoint

KILL_POINTS = {
    # the training state of step_4 half written into .step_4.tmp
    "state": "step_latest -> step_2",
    # step_4 renamed into place, step_latest not yet repointed
    "link": "step_latest -> step_2",
    # step_latest -> step_4, step_2 half deleted by the pruning
    "prune": "step_latest -> step_4",
}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _child(out: Path, point: str) -> None:
    """Train RUN into ``out`` and SIGKILL this process at ``point`` while checkpoint step_4 is written."""
    from dspark.training import checkpoints

    writing_step_4 = lambda path: ".step_4." in str(path)  # noqa: E731
    real_save, real_symlink, real_rmtree = torch.save, os.symlink, shutil.rmtree

    def save(obj, path, *args, **kw):
        if point == "state" and writing_step_4(path):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            Path(path).write_bytes(buffer.getvalue()[: buffer.tell() // 2])
            _die()
        real_save(obj, path, *args, **kw)

    def symlink(src, dst, *args, **kw):
        if point == "link" and src == "step_4":
            _die()
        real_symlink(src, dst, *args, **kw)

    def rmtree(path, *args, **kw):
        if point == "prune" and str(path).endswith(".step_2.deleting") and Path(path).exists():
            os.remove(Path(path) / "training_state.rank0.pt")  # part of the folder is gone
            _die()
        real_rmtree(path, *args, **kw)

    checkpoints.torch.save, checkpoints.os.symlink, checkpoints.shutil.rmtree = save, symlink, rmtree
    train(run_cfg(out), target=tiny_target(), dataset=random_data(6))


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_sigkill_while_writing_a_checkpoint_then_resume_matches_an_uninterrupted_run(tmp_path, point,
                                                                                     uninterrupted):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "tests.training.test_checkpoints", str(out), point],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert f"step_latest -> {latest_checkpoint(out).name}" == KILL_POINTS[point]
    assert all((folder / "training_state.rank0.pt").is_file() for _, folder in checkpoint_folders(out))
    with pytest.raises(DSparkError, match="--resume"):  # a new run does not write over it
        train(run_cfg(out), target=tiny_target(), dataset=random_data(6))
    with open(out / "metrics.jsonl", "a") as f:  # a log line the kill cut off
        f.write('{"step": 5, "lo')
    start = load_training_state(resume_checkpoint(out), 0)["master_weights"]
    last = train(run_cfg(out), resume=True, target=tiny_target(), dataset=random_data(6))
    assert last == out / "step_6" and latest_checkpoint(out) == last.resolve()
    assert [n for n, _ in checkpoint_folders(out)] == [6]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # leftovers of the killed write are gone
    assert_same_run(uninterrupted, out)
    # negative control: the resumed session did change the weights, so the equality above is informative
    assert not all(torch.equal(a, b) for a, b in zip(start, final_weights(out), strict=True))


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2])
