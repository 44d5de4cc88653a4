"""scripts/answer_stats.py: the per-domain table of a stage's answers, and its error on a missing file."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "answer_stats.py"


def _record(domain: str, source: str, prompt: str, answer: str) -> str:
    turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return json.dumps({"id": prompt, "domain": domain, "source": source, "conversations": turns}) + "\n"


def test_the_table_groups_by_domain_or_source_and_skips_records_without_an_answer(tmp_path):
    f = tmp_path / "answers.jsonl"
    f.write_text(_record("math", "a", "xx", "yyyy") + _record("code", "b", "x" * 10, "y")
                 + _record("math", "b", "xxxx", "yy")
                 + json.dumps({"id": "u", "domain": "chat", "conversations": [{"role": "user", "content": "q"}]}) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[2:] == ["| math | 2 | 3 | 3 |", "| code | 1 | 10 | 1 |"]
    by_source = subprocess.run([sys.executable, str(SCRIPT), str(f), "--by", "source"], capture_output=True,
                               text=True, check=True).stdout
    assert by_source.splitlines()[0].startswith("| source |") and "| b | 2 | 7 | 2 |" in by_source


def test_a_missing_or_broken_file_is_a_one_line_error(tmp_path):
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: no answers file {tmp_path / 'none.jsonl'}"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    broken = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True)
    assert broken.returncode == 2 and f"{bad}:1 is not valid JSON" in broken.stderr
    assert "Traceback" not in broken.stderr
