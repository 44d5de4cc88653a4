"""docs/reports/performance.md holds one section per `dspark bench speed --out-dir`: a rerun replaces its own
section and keeps the others, the prose outside the sections and the shared definitions."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.bench.speed_report import (
    DEFINITIONS_KEY, PAGE_TITLE, render_markdown, replace_section, section_body, write_outputs,
)

ROOT = Path(__file__).resolve().parents[2]


def _result(tok_s: float, command: str) -> dict:
    """A recorded run (docs/performance/bf16/speed.json) with its first row's speed and its command replaced."""
    result = json.loads((ROOT / "docs" / "performance" / "bf16" / "speed.json").read_text())
    result["rows"][0]["tokens_per_s"] = tok_s
    result["command"] = command
    return result


def test_a_rerun_replaces_its_own_section_only(tmp_path):
    doc = tmp_path / "performance.md"
    write_outputs(_result(11.0, "dspark bench speed --a"), tmp_path / "a", str(doc), "Setting A")
    write_outputs(_result(22.0, "dspark bench speed --b"), tmp_path / "b", str(doc), "Setting B")
    page = doc.read_text()
    assert page.startswith(f"# {PAGE_TITLE}\n") and page.count("## Definitions") == 1
    assert page.index("## Setting A") < page.index("## Setting B") < page.index("## Definitions")
    doc.write_text(page.replace(f"# {PAGE_TITLE}\n", f"# {PAGE_TITLE}\n\nHand-written intro.\n"))

    write_outputs(_result(33.0, "dspark bench speed --a2"), tmp_path / "a", str(doc))  # rerun of A, no title
    page = doc.read_text()
    a, b = section_body(page, (tmp_path / "a").as_posix()), section_body(page, (tmp_path / "b").as_posix())
    assert a.startswith("## Setting A\n")  # the heading survives a rerun without --doc-title
    assert "dspark bench speed --a2" in a and "| 33.0 |" in a and "--a`" not in page and "| 11.0 |" not in page
    assert "dspark bench speed --b" in b and "| 22.0 |" in b
    assert "Hand-written intro." in page and page.count("## Setting A") == 1
    assert section_body(page, DEFINITIONS_KEY).startswith("## Definitions")
    # the run's own report beside its data is the whole page of that run, definitions included
    assert (tmp_path / "a" / "speed.md").read_text() == render_markdown(_result(33.0, "dspark bench speed --a2"))


def test_replace_section_appends_a_missing_one_before_the_definitions():
    page = replace_section("# T\n", DEFINITIONS_KEY, "## Definitions\n\nd")
    page = replace_section(page, "x", "## X\n\nx body")
    assert page.index("## X") < page.index("## Definitions")
    assert section_body(page, "y") is None
    assert replace_section(page, "x", "## X\n\nnew") == page.replace("x body", "new")


def test_the_committed_page_has_a_section_per_data_folder():
    page = (ROOT / "docs" / "reports" / "performance.md").read_text()
    for folder in ("docs/performance", "docs/performance/bf16", "docs/performance/hybrid", "docs/performance/variants"):
        body = section_body(page, folder)
        assert body is not None and "Reproduce: `dspark bench speed" in body.split("\n\n", 2)[1], folder
        assert (ROOT / folder / "speed.json").is_file()
