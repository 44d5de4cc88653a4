"""docs/reports/long-training.md from fake training summaries and a fake eval folder (bench/long_training.sh's last step)."""

from __future__ import annotations

import json

from dspark.studies.long_training import write_long_training_page


def test_the_page_has_one_training_row_per_drafter_and_the_eval_table(tmp_path):
    metrics = {"acc@1": 0.5, "acc@2": 0.25, "tau": 1.625}
    for name, steps in (("short", 10), ("long", 40), ("dflash", 40)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train_summary.json").write_text(json.dumps(
            {"steps": steps, "tokens_seen": 1000.0 * steps, "tokens_per_s": 99.6, "final_metrics": metrics}))
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "acceptance_math.png").write_bytes(b"png")
    (ev / "results.md").write_text("# Offline evaluation\n\n| Drafter | GSM8K |\n")
    page = write_long_training_page(tmp_path / "long", ev, "2700", tmp_path / "short", tmp_path / "dflash",
                                    docs=tmp_path / "docs")
    text = page.read_text()
    assert "Written by `bash bench/long_training.sh 2700`" in text
    assert "| dspark-markov-long | 2700 s, bfloat16, 1 thread (this script) | 40 | 40000 | 100 | 0.50 0.25 | 1.625 |" in text
    assert "| dflash-long | 40 steps like dspark-markov-long, bfloat16, 1 thread |" in text
    assert text.endswith("| Drafter | GSM8K |\n") and (tmp_path / "docs" / "figures" / "long_training_acceptance_math.png").is_file()
