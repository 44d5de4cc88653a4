"""scripts/scale_archive.sh: the regenerated answers kept in git, saved in parts, restored, checked."""

import gzip
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scale_archive.sh"


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {"PATH": "/usr/bin:/bin", "R": str(tmp_path / "r"), "A": str(tmp_path / "a"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full)


def _write(path: Path, ids: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f'{{"id": {i}}}\n' for i in ids))


def test_parts_saved_as_the_file_grows_restore_it_byte_for_byte(tmp_path):
    src = tmp_path / "r" / "regenerated-R.jsonl"
    _write(src, [0, 1, 2])
    assert _run(tmp_path, "save").returncode == 0
    _write(src, [0, 1, 2, 3, 4])
    assert _run(tmp_path, "save").returncode == 0
    parts = (tmp_path / "a" / "parts.tsv").read_text().split("\n")[:-1]
    assert [p.split("\t")[:3] for p in parts] == [["part-01.jsonl.gz", "0", "3"], ["part-02.jsonl.gz", "3", "5"]]
    assert gzip.decompress((tmp_path / "a" / "part-02.jsonl.gz").read_bytes()) == b'{"id": 3}\n{"id": 4}\n'
    whole = src.read_bytes()

    src.unlink()  # a fresh machine
    assert _run(tmp_path, "restore").returncode == 0
    assert src.read_bytes() == whole
    _write(src, [0, 1])  # a run that had only begun: the rest is appended
    assert _run(tmp_path, "restore").returncode == 0
    assert src.read_bytes() == whole
    _write(src, [0, 1, 2, 3, 4, 5])  # further than the archive: left as it is, the new line saved next
    assert _run(tmp_path, "restore").returncode == 0
    assert _run(tmp_path, "save").returncode == 0
    assert "part-03.jsonl.gz\t5\t6" in (tmp_path / "a" / "parts.tsv").read_text()


def test_another_file_or_a_damaged_part_is_one_line_and_nothing_is_overwritten(tmp_path):
    src = tmp_path / "r" / "regenerated-R.jsonl"
    _write(src, [0, 1, 2])
    assert _run(tmp_path, "save").returncode == 0
    _write(src, [7, 8, 9, 10])  # another regeneration
    for cmd in ("save", "restore"):
        out = _run(tmp_path, cmd)
        assert out.returncode == 2 and len(out.stderr.strip().split("\n")) == 1
        assert "not the archived ones" in out.stderr
    assert src.read_text().startswith('{"id": 7}')

    (tmp_path / "a" / "part-01.jsonl.gz").write_bytes(gzip.compress(b'{"id": 5}\n'))
    src.unlink()
    out = _run(tmp_path, "restore")
    assert out.returncode == 2 and "part-01.jsonl.gz: its lines do not match" in out.stderr
    assert len(out.stderr.strip().split("\n")) == 1 and not src.exists()


def test_the_size_cap_refuses_a_part_and_keeps_the_archive(tmp_path):
    src = tmp_path / "r" / "regenerated-R.jsonl"
    _write(src, list(range(50)))
    out = _run(tmp_path, "save", MAX_KIB="0")
    assert out.returncode == 2 and "over MAX_KIB=0" in out.stderr
    assert not list((tmp_path / "a").glob("*.gz*"))
