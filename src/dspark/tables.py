"""Markdown tables and number cells: the one renderer behind every report (evaluation, benchmarks, studies)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

DASH = "–"  # the cell of a missing number

Column = tuple[str, Callable[[Any], str]]  # (title, record -> cell text)


def fmt(x: float | None, digits: int = 2) -> str:
    """``x`` with ``digits`` decimals; None and NaN become a dash."""
    return DASH if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], bold_best: bool = False) -> list[str]:
    """A Markdown table, first column left-aligned and the others right-aligned.

    With ``bold_best`` the highest number of each column after the first is bold (a cell's leading number counts).
    """
    rows = [list(r) for r in rows]
    if bold_best and len(rows) > 1:
        for col in range(1, len(header)):
            nums = []
            for r in rows:
                try:  # a cell may carry an interval after its value: "1.62 [1.55, 1.70]"
                    nums.append(float(r[col].split(" [", 1)[0]))
                except ValueError:
                    nums.append(None)
            best = max((n for n in nums if n is not None), default=None)
            for r, n in zip(rows, nums):
                if best is not None and n == best:
                    r[col] = f"**{r[col]}**"
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def records_table(columns: Sequence[Column], records: Sequence[Any]) -> list[str]:
    """A Markdown table with one row per record, one column per (title, cell function)."""
    return markdown_table([title for title, _ in columns], [[cell(r) for _, cell in columns] for r in records])
