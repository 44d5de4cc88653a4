"""The one Markdown table renderer and number cell shared by every report."""

from __future__ import annotations

from dspark.tables import DASH, fmt, markdown_table, records_table


def test_fmt_dashes_missing_numbers():
    assert fmt(1.23456) == "1.23" and fmt(2, 1) == "2.0" and fmt(None) == DASH and fmt(float("nan"), 3) == DASH


def test_markdown_table_aligns_numbers_right_and_bolds_the_best():
    lines = markdown_table(["name", "a", "b"], [["x", "1.00", "–"], ["y", "2.00", "3"]], bold_best=True)
    assert lines == ["| name | a | b |", "|---|---:|---:|", "| x | 1.00 | – |", "| y | **2.00** | **3** |"]


def test_records_table_has_one_row_per_record():
    columns = [("policy", lambda r: r["policy"]), ("tok/s", lambda r: fmt(r["tps"], 1))]
    assert records_table(columns, [{"policy": "alg1", "tps": 12.34}, {"policy": "all", "tps": None}]) == [
        "| policy | tok/s |", "|---|---:|", "| alg1 | 12.3 |", f"| all | {DASH} |"]
