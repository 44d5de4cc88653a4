"""The table of docs/serving/simulator-validation.md: measured against simulated, for the three timing tables.

    python scripts/simulator_validation_report.py docs/serving/validation

Reads simulate_before.json, simulate_after.json and simulate_observed.json (each `dspark simulate ... --compare`
output of scripts/simulator_validation.sh) and prints a Markdown table, then how many errors lie within 15 %.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.tables import fmt, markdown_table

VARIANTS = ("before", "after", "observed")
LIMIT = 15.0


def main(folder: str) -> None:
    comparisons = {v: json.loads((Path(folder) / f"simulate_{v}.json").read_text())["comparison"] for v in VARIANTS}
    rows, within = [], {v: 0 for v in VARIANTS}
    total = 0
    for i, first in enumerate(comparisons[VARIANTS[0]]):
        cells = [first["policy"], str(first["concurrency"])]
        for metric in ("total_tokens_per_s", "user_tokens_per_s"):
            cells.append(fmt(first[f"measured_{metric}"]))
            for v in VARIANTS:
                c = comparisons[v][i]
                err = 100.0 * c[f"error_{metric}"]  # stored as a fraction
                within[v] += abs(err) <= LIMIT
                cells.append(f"{fmt(c[f'simulated_{metric}'])} ({err:+.1f} %)")
            total += 1
        cells += [fmt(first["measured_avg_verify_len"]), fmt(comparisons["observed"][i]["simulated_avg_verify_len"])]
        rows.append(cells)
    header = ["policy", "users", "measured tok/s", *(f"sim {v}" for v in VARIANTS),
              "measured tok/s/user", *(f"sim {v}" for v in VARIANTS), "measured verify len", "simulated verify len"]
    print("\n".join(markdown_table(header, rows)))
    print()
    print(", ".join(f"{v}: {within[v]} of {total} within {LIMIT:g} %" for v in VARIANTS))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/serving/validation")
