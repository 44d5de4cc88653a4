"""The per-domain table of a stage of answers in docs/reports/training-scale.md: answers, mean first user turn and
mean answer in characters, from the merged file of `dspark data regenerate` / `dspark data merge`.

    python scripts/answer_stats.py runs/scale/regenerated-S6.jsonl            # stages 5-6: by domain
    python scripts/answer_stats.py runs/scale/regenerated-S3.jsonl --by source  # stage 3: by archive

Counts every record with a user turn and an assistant answer; the order of rows is the order groups first appear.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspark.data.regenerate_io import read_jsonl
from dspark.errors import DSparkError


def answer_stats(records: list[dict], by: str = "domain") -> dict[str, tuple[int, float, float]]:
    """group -> (answers, mean prompt characters, mean answer characters)."""
    sums: dict[str, list[int]] = {}
    for rec in records:
        turns = rec.get("conversations") or []
        prompt = next((t["content"] for t in turns if t.get("role") == "user"), None)
        answer = next((t["content"] for t in reversed(turns) if t.get("role") == "assistant"), None)
        if prompt is None or answer is None:
            continue
        s = sums.setdefault(str(rec.get(by, "?")), [0, 0, 0])
        s[0] += 1
        s[1] += len(prompt)
        s[2] += len(answer)
    return {g: (n, p / n, a / n) for g, (n, p, a) in sums.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("answers", type=Path, help="JSONL of answers (records with `conversations`)")
    ap.add_argument("--by", default="domain", help="record field to group by (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        if not args.answers.is_file():
            raise DSparkError(f"no answers file {args.answers}")
        stats = answer_stats(read_jsonl(args.answers), args.by)
    except DSparkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"| {args.by} | answers | mean prompt (characters) | mean answer (characters) |")
    print("|---|---:|---:|---:|")
    for group, (n, p, a) in stats.items():
        print(f"| {group} | {n:,} | {p:.0f} | {a:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
