"""The Python examples of docs/guide/ run: each page's ```python blocks, in order, as one script.

A page runs from a scratch folder in which ``checkpoints/`` is the repository's, so its examples read the shipped
reference drafter and write under ``runs/`` without touching the checkout. The pages use the real SmolLM2
(``dspark prepare``), so the test is marked ``real_model``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"
_PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return [m.group(1) for m in _PYTHON_BLOCK.finditer(text)]


def run_page(page: Path, workdir: Path) -> dict:
    """Execute the page's Python blocks in one namespace from ``workdir``; returns the namespace."""
    (workdir / "checkpoints").symlink_to(ROOT / "checkpoints", target_is_directory=True)
    namespace: dict = {"__name__": "__docs__"}
    label = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        for number, block in enumerate(python_blocks(page.read_text(encoding="utf-8")), 1):
            exec(compile(block, f"{label} (python block {number})", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def pages_with_examples() -> list[Path]:
    return [p for p in sorted(GUIDE.rglob("*.md")) if python_blocks(p.read_text(encoding="utf-8"))]


def test_the_api_page_has_examples():
    page = GUIDE / "python-api.md"
    assert page in pages_with_examples() and len(python_blocks(page.read_text(encoding="utf-8"))) >= 6


@pytest.mark.real_model
@pytest.mark.parametrize("page", pages_with_examples(), ids=lambda p: str(p.relative_to(ROOT)))
def test_guide_examples_run(page: Path, tmp_path: Path, capsys) -> None:
    namespace = run_page(page, tmp_path)
    assert capsys.readouterr().out.strip(), "the examples print what they show"
    if page.name == "python-api.md":  # what the page's text says the examples do
        out = namespace["out"]
        assert out.text and out.acceptance_length >= 1.0 and out.finish_reason in ("stop", "length")
        assert (tmp_path / "runs" / "api-drafter" / "step_2").is_dir()


def test_a_failing_example_fails_the_page(tmp_path: Path) -> None:
    """Negative control: blocks share one namespace and run in order; a wrong assertion in one fails the page;
    bash blocks and indented text are not run."""
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n```python\nx = 2\n```\n\n```bash\nexit 1\n```\n\n    raise SystemExit\n\n"
                    "```python\nassert x == 2\ny = x + 1\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    assert run_page(page, work)["y"] == 3
    page.write_text(page.read_text() + "\n```python\nassert y == 4, 'the page says 4'\n```\n")
    work2 = tmp_path / "work2"
    work2.mkdir()
    with pytest.raises(AssertionError, match="the page says 4"):
        run_page(page, work2)
