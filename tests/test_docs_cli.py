"""docs/guide/cli.md is what ``python -m dspark.cli_reference`` renders from today's parsers."""

from __future__ import annotations

from pathlib import Path

from dspark import cli_reference
from dspark.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guide" / "cli.md"


def test_the_cli_reference_is_current():
    assert PAGE.read_text(encoding="utf-8") == cli_reference.render(), \
        "docs/guide/cli.md is stale: run `python -m dspark.cli_reference`"


def test_every_command_has_a_section():
    page = PAGE.read_text(encoding="utf-8")
    for name, _, sub in cli_reference._subcommands(build_parser()):
        assert f"\n### dspark {name}\n" in page
        for inner, _, _ in cli_reference._subcommands(sub):
            assert f"\n#### dspark {name} {inner}\n" in page


def test_a_new_flag_makes_the_page_stale(tmp_path, capsys):
    """Negative control: the check fails once a parser gains a flag, and passes on a freshly written page."""
    parser = build_parser()
    generate = dict((n, p) for n, _, p in cli_reference._subcommands(parser))["generate"]
    generate.add_argument("--brand-new-flag", default=3, help="a flag the page does not have (default: %(default)s)")
    changed = cli_reference.render(parser)
    assert changed != cli_reference.render()
    assert "| `--brand-new-flag BRAND_NEW_FLAG` | a flag the page does not have (default: 3) |" in changed
    page = tmp_path / "cli.md"
    page.write_text(changed)
    assert cli_reference.main(["--check", "--out", str(page)]) == 1
    assert cli_reference.main(["--out", str(page)]) == 0 and cli_reference.main(["--check", "--out", str(page)]) == 0
    assert "stale" in capsys.readouterr().err
