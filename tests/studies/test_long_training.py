"""docs/reports/long-training.md's tables from fake training summaries and a fake eval folder (scripts/long_training.sh's last step)."""

from __future__ import annotations

import json

import pytest

from dspark.studies.long_training import BEGIN, END, write_long_training_tables

PROSE = "# A longer training budget\n\nWritten by `bash scripts/long_training.sh 2700`: what the page says.\n\n"
AFTER = "\n\n## Figures\n\nThe page's own note on the figures.\n"


def _runs(tmp_path):
    metrics = {"acc@1": 0.5, "acc@2": 0.25, "tau": 1.625}
    for name, steps in (("short", 10), ("long", 40), ("dflash", 40)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train_summary.json").write_text(json.dumps(
            {"steps": steps, "tokens_seen": 1000.0 * steps, "tokens_per_s": 99.6, "final_metrics": metrics}))
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "acceptance_math.png").write_bytes(b"png")
    (ev / "results.md").write_text("# Offline evaluation\n\n| Drafter | GSM8K |\n\n## Figures\n\n![a](acceptance_math.png)\n")
    return [("dspark-markov", tmp_path / "short", "540 s, float32, 2 threads (`dspark reproduce --budget cpu`)"),
            ("dspark-markov-long", tmp_path / "long", "2700 s, bfloat16, 1 thread (this script)"),
            ("dflash-long", tmp_path / "dflash", "40 steps like dspark-markov-long, bfloat16, 1 thread")], ev


def test_the_tables_go_between_the_markers_and_the_page_text_stays(tmp_path):
    runs, ev = _runs(tmp_path)
    page = tmp_path / "docs" / "long-training.md"
    page.parent.mkdir()
    page.write_text(PROSE + BEGIN + "\nold tables\n" + END + AFTER)
    write_long_training_tables(page, runs, ev)
    text = page.read_text()
    assert text.startswith(PROSE + BEGIN + "\n") and text.endswith(END + AFTER) and "old tables" not in text
    assert "Written by `bash scripts/long_training.sh 2700`" in text
    assert "| dspark-markov-long | 2700 s, bfloat16, 1 thread (this script) | 40 | 40000 | 100 | 0.50 0.25 | 1.625 |" in text
    assert "| dflash-long | 40 steps like dspark-markov-long, bfloat16, 1 thread |" in text
    assert "| Drafter | GSM8K |\n" + END in text and "![a]" not in text  # the eval folder's own figures stay there
    assert (tmp_path / "docs" / "figures" / "long_training_acceptance_math.png").is_file()
    write_long_training_tables(page, runs, ev)
    assert page.read_text() == text  # rewriting is idempotent


def test_a_page_without_markers_is_refused(tmp_path):
    runs, ev = _runs(tmp_path)
    page = tmp_path / "long-training.md"
    page.write_text(PROSE)
    with pytest.raises(ValueError, match="markers"):
        write_long_training_tables(page, runs, ev)
    assert page.read_text() == PROSE


def test_the_shipped_page_has_the_markers():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "reports" / "long-training.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)
