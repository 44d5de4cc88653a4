"""The CLI reference page (docs/guide/cli.md), generated from the argparse definitions ``dspark.cli`` builds.

    python -m dspark.cli_reference              # rewrite docs/guide/cli.md
    python -m dspark.cli_reference --check      # exit 1 when the page differs from the parsers (tests do this)

Every command and command group gets a section: its description, usage, arguments with their help (defaults
expanded as `--help` shows them) and the epilog's examples. The text does not depend on the terminal: usage is
formatted at a fixed width.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PAGE = Path("docs/guide/cli.md")
WIDTH = 100  # columns argparse formats usage lines to

HEADER = """\
# CLI reference

Every `dspark` command, its arguments and their defaults, generated from the argparse definitions by
`python -m dspark.cli_reference` (`tests/test_docs_cli.py` fails when this page is stale). `dspark COMMAND
--help` prints the same. A walk through the commands in the order a project uses them: [your own
model](own-model.md).
"""


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order `--help` lists them; an alias (another
    name of the same parser) is named in its command's help, not given a section of its own."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            names: dict[int, list[str]] = {}
            for name, sub in action.choices.items():
                names.setdefault(id(sub), []).append(name)
            found = []
            for name, sub in action.choices.items():
                first, *aliases = names[id(sub)]
                if name == first:
                    note = f" (alias: {', '.join(aliases)})" if aliases else ""
                    found.append((name, helps.get(name, "") + note, sub))
            return found
    return []


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
            name = ", ".join(f"`{flag}{metavar}`" for flag in action.option_strings)
        else:
            name = f"`{formatter._format_args(action, formatter._get_default_metavar_for_positional(action))}`"
        help_text = formatter._expand_help(action) if action.help else ""
        if action.choices and "{" not in name and not isinstance(action.choices, dict):
            help_text += f" (choices: {', '.join(map(str, action.choices))})"
        rows.append(f"| {name} | {_cell(help_text)} |")
    return rows


def _section(path: list[str], help_line: str, parser: argparse.ArgumentParser) -> list[str]:
    level = "#" * min(len(path) + 1, 4)
    lines = [f"{level} {' '.join(path)}", ""]
    text = parser.description or help_line
    if text:
        lines += [_cell(text), ""]
    lines += ["```text", parser.format_usage().strip().removeprefix("usage: "), "```", ""]
    rows = _argument_rows(parser)
    if rows:
        lines += ["| argument | what it does |", "|---|---|", *rows, ""]
    subs = _subcommands(parser)
    if subs:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| [`{' '.join(path[1:] + [name])}`](#{'-'.join(path + [name])}) | {_cell(h)} |"
                  for name, h, _ in subs] + [""]
    if parser.epilog:
        lines += ["```text", parser.epilog.strip("\n"), "```", ""]
    for name, sub_help, sub in subs:
        lines += _section(path + [name], sub_help, sub)
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page for ``parser`` (default: the real `dspark` parser)."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # argparse sizes usage lines from the terminal; fix it
    try:
        if parser is None:
            from dspark.cli import build_parser

            parser = build_parser()
        lines = _section(["dspark"], "", parser)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return HEADER + "\n" + "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.cli_reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_PAGE, help="the page to write or check (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python -m dspark.cli_reference", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
