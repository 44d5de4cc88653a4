"""Every relative link and image in README.md and docs/**/*.md points to a file that exists.

Links to the web (http, https), mailto: links and pure ``#anchors`` are not checked; a
``#fragment`` after a relative path is stripped. Links inside code (fenced blocks, `inline`)
are not links and are skipped.

Code comments cite a section of a page as ``docs/<page>.md §<heading>``; every such citation in
src/, docs/ and README.md must name an existing page and one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# [text](target) and ![alt](target); target may be <wrapped> and followed by a "title"
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+[\"'(][^)]*)?\)")
# [label]: target  (reference definitions)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
# <img src="..."> and <a href="...">
_HTML = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_EXTERNAL = ("http://", "https://", "mailto:")
# docs/<page>.md §<heading ...>; the text after § runs to the next citation or the end of the line
_CITATION = re.compile(r"docs/([\w./-]+\.md) ?§ ?((?:(?!docs/)[^\n])*)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def markdown_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    files = [root / "README.md"] if (root / "README.md").exists() else []
    return files + sorted((root / "docs").rglob("*.md"))


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link, image and reference definition outside code."""
    # blank out code while keeping line numbers
    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    text = _CODE_SPAN.sub(blank, _FENCE.sub(blank, text))
    found = []
    for pattern in (_INLINE, _REFERENCE, _HTML):
        for match in pattern.finditer(text):
            target = match.group(1).strip()
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((text.count("\n", 0, match.start()) + 1, target))
    return sorted(found)


def broken_links(path: Path) -> list[str]:
    """'file:line: target' for each relative link of ``path`` whose file does not exist."""
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    broken = []
    for line, target in link_targets(path.read_text(encoding="utf-8")):
        if target.lower().startswith(_EXTERNAL) or target.startswith("#") or not target:
            continue
        relative = target.split("#", 1)[0].split("?", 1)[0]
        if not relative:
            continue
        resolved = (ROOT / relative.lstrip("/")) if relative.startswith("/") else (path.parent / relative)
        if not resolved.exists():
            broken.append(f"{label}:{line}: {target}")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = broken_links(path)
    assert broken == [], "\n".join(broken)


def test_the_guide_and_the_reports_are_checked() -> None:
    """docs/guide/ and docs/reports/ (and every other folder under docs/) are among the checked pages."""
    checked = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    for folder in ("docs/guide", "docs/reports"):
        pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).glob("*.md")}
        assert pages and pages <= checked, folder
    assert {"docs/guide/python-api.md", "docs/guide/cli.md", "docs/reports/performance.md"} <= checked


def test_checker_finds_a_broken_link(tmp_path: Path) -> None:
    """Negative control: the same check fails on a file with broken links and passes the good ones."""
    (tmp_path / "real.png").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "page.md").write_text("# page\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n"
        "![ok](real.png) [ok](sub/page.md#page) [web](https://example.com/x.png) [top](#title)\n"
        "[mail](mailto:someone@example.com)\n"
        "![missing figure](figures/missing.png)\n"
        "see [the guide](no-such-guide.md#setup \"title\")\n"
        "[ref]: missing-ref.md\n"
        '<img src="missing-html.png">\n'
        "`[in code](not-checked.md)`\n"
        "```\n[in a fence](not-checked-either.md)\n```\n"
    )
    broken = broken_links(doc)
    assert [entry.split(": ", 1)[1] for entry in broken] == [
        "figures/missing.png",
        "no-such-guide.md#setup",
        "missing-ref.md",
        "missing-html.png",
    ]
    assert [entry.rsplit(":", 2)[1] for entry in broken] == ["4", "5", "6", "7"]


def headings(page: Path) -> list[str]:
    """The heading texts of a Markdown page (outside fenced code)."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return [h.strip() for h in _HEADING.findall(text)]


def broken_citations(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: citation' for each ``docs/X.md §Heading`` in ``path`` whose page or heading is missing."""
    label = path.relative_to(root) if path.is_relative_to(root) else path.name
    broken = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in _CITATION.finditer(line):
            page, rest = root / "docs" / match.group(1), match.group(2)
            if rest.startswith("<"):  # the pattern itself, as in "docs/X.md §<heading>"
                continue
            found = page.exists() and any(
                rest.startswith(h) and (len(rest) == len(h) or not rest[len(h)].isalnum()) for h in headings(page))
            if not found:
                broken.append(f"{label}:{number}: docs/{match.group(1)} §{rest}")
    return broken


def citing_files(root: Path = ROOT) -> list[Path]:
    """Source and test files (code, configs, package docs), README.md and the docs pages; not this file,
    whose fixtures cite missing headings on purpose."""
    sources = [p for folder in ("src", "tests") for p in (root / folder).rglob("*")
               if p.suffix in {".py", ".json", ".md"} and p.is_file() and p != Path(__file__).resolve()]
    return sorted(sources) + markdown_files(root)


def test_section_citations_resolve() -> None:
    broken = [entry for path in citing_files() for entry in broken_citations(path)]
    assert broken == [], "\n".join(broken)


def test_citation_checker_finds_a_missing_heading(tmp_path: Path) -> None:
    """Negative control: a missing page or heading is reported, an existing heading passes."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Blocks and slots\n\ntext\n")
    code = tmp_path / "module.py"
    code.write_text(
        '"""Slot k predicts anchor + k + 1 (docs/guide.md §Blocks and slots)."""\n'
        "# docs/guide.md §Blocks, see also\n"
        "# docs/guide.md §Blocks and slotsx\n"
        "# docs/missing.md §Blocks and slots\n"
        "# (docs/guide.md §Guide, docs/guide.md §Nothing here)\n"
    )
    broken = broken_citations(code, tmp_path)
    assert [entry.split(":", 2)[1] for entry in broken] == ["2", "3", "4", "5"]
    assert broken[-1].endswith("docs/guide.md §Nothing here)")
