"""The functions with the most samples in a py-spy profile (``py-spy record --format raw``: one collapsed stack per
line, frames joined by ``;``, then the sample count), as Markdown: self share, inclusive share, and the share of
samples under each given frame (``--under``), e.g. the engine's steps that carry prompt pieces.

    python scripts/collapsed_stacks.py runs/serve-profile/stacks.txt --under engine.py:400 --under DSparkDrafter.propose
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stacks", type=Path, help="py-spy raw output")
    p.add_argument("--top", type=int, default=20, help="rows per table (default: %(default)s)")
    p.add_argument("--under", action="append", default=[], metavar="TEXT",
                   help="also print the share of samples with a frame containing TEXT (repeatable)")
    p.add_argument("--title", default=None, help="a line printed first (the command that made the profile)")
    args = p.parse_args()
    if not args.stacks.is_file():
        raise SystemExit(f"collapsed_stacks.py: no file {args.stacks}")
    own, inclusive, under, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    with open(args.stacks, encoding="utf-8", errors="replace", newline="") as f:  # py-spy writes junk frames at times:
        text = f.read()  # bytes that are not UTF-8, a \r or a \x85 inside a name; only \n ends a line
    for number, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise SystemExit(f"collapsed_stacks.py: {args.stacks}:{number} is not 'frame;frame;... count'")
        n, frames = int(count), stack.split(";") if stack else ["(no Python frame)"]  # py-spy: a native-only sample
        total += n
        own[frames[-1]] += n
        for frame in dict.fromkeys(frames):  # once per stack, in stack order (ties print the same each run)
            inclusive[frame] += n
        for text in args.under:
            under[text] += n * any(text in f for f in frames)
    if total == 0:
        raise SystemExit(f"collapsed_stacks.py: {args.stacks} holds no samples")
    if args.title:
        print(args.title + "\n")
    print(f"{total} samples.\n")
    if args.under:
        print("| samples under | share |\n|---|---:|")
        for text in args.under:
            print(f"| `{text}` | {100 * under[text] / total:.1f} % |")
        print()
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"| {title} share | function (file:line) |\n|---:|---|")
        for frame, n in counter.most_common(args.top):
            print(f"| {100 * n / total:.1f} % | `{frame}` |")
        print()


if __name__ == "__main__":
    main()
