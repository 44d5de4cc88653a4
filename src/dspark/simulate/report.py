"""Sweeps of simulated (policy, load) points, their comparison with measured rows, and the report files.

Rows have ``dspark bench serve``'s keys (``policy``, ``concurrency`` = load, ``total_tokens_per_s``,
``user_tokens_per_s``, ``avg_verify_len``, ``acceptance_length``, ...), so the paper's Figure 7 and 8 plots of
``dspark.evaluation.plots`` draw both.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from dspark.simulate.engine import StepClock, Workload, simulate
from dspark.simulate.stats import DrafterStats
from dspark.tables import Column, fmt, records_table


def sweep(policies: Sequence[str], loads: Sequence[float], stats: DrafterStats, clock: StepClock,
          workload: Callable[[float], Workload], seed: int = 0, fallback_confidence: float = 1.0,
          label: str = "", log=print, policy_sps=None) -> list[dict]:
    """One simulated row per (policy, load); ``workload(load)`` builds the arrivals. ``policy_sps``: the table
    the policies plan with, when it is not the one that times the steps (``clock.verify``)."""
    rows = []
    for policy in policies:
        for load in loads:
            start = time.perf_counter()
            res = simulate(policy, stats, clock, workload(load), seed, fallback_confidence, policy_sps)
            row = res.row()
            row["policy"] = f"{label}{policy}"
            row["sim_seconds"] = time.perf_counter() - start
            rows.append(row)
            log(f"  {row['policy']:>16} load {load:<6g} {row['total_tokens_per_s']:9.1f} tok/s total, "
                f"{row['user_tokens_per_s']:7.1f} tok/s/user, verify {row['avg_verify_len'] or 0:.2f}, "
                f"tau {row['acceptance_length'] or 0:.2f} ({row['sim_seconds']:.1f} s)")
    return rows


def _curve(rows: Sequence[Mapping], policy: str) -> tuple[np.ndarray, np.ndarray]:
    """(throughput, per-user speed) of one policy in load order, cut where throughput stops rising."""
    group = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["concurrency"])
    xs, ys = [], []
    for r in group:
        if xs and r["total_tokens_per_s"] <= xs[-1]:
            break
        xs.append(r["total_tokens_per_s"])
        ys.append(r["user_tokens_per_s"])
    return np.array(xs), np.array(ys)


def user_speed_at(rows: Sequence[Mapping], policy: str, throughput: float) -> float | None:
    """``policy``'s per-user speed at ``throughput`` total tokens/s: linear along its curve between the two points
    around it; None outside the curve's throughput range (nothing is extrapolated)."""
    px, py = _curve(rows, policy)
    return float(np.interp(throughput, px, py)) if len(px) and px[0] <= throughput <= px[-1] else None


def matched_throughput(rows: Sequence[Mapping], policy: str, baseline: str) -> list[dict]:
    """Per-user speed of ``policy`` over ``baseline`` at the baseline's throughputs (``user_speed_at``); points
    outside ``policy``'s throughput range are skipped."""
    out = []
    for x, y in zip(*_curve(rows, baseline)):
        speed = user_speed_at(rows, policy, x)
        if speed is not None:
            out.append({"throughput": float(x), "baseline_user_speed": float(y), "user_speed": speed,
                        "ratio": speed / y if y else None})
    return out


def compare(simulated: Sequence[Mapping], measured: Sequence[Mapping]) -> list[dict]:
    """Simulated against measured rows of the same (policy, concurrency), with relative errors."""
    sim = {(r["policy"], float(r["concurrency"])): r for r in simulated}
    out = []
    for m in measured:
        s = sim.get((m["policy"], float(m["concurrency"])))
        if s is None or not m.get("requests"):
            continue
        row = {"policy": m["policy"], "concurrency": m["concurrency"]}
        for key in ("total_tokens_per_s", "user_tokens_per_s", "avg_verify_len", "acceptance_length"):
            mv, sv = m.get(key), s.get(key)
            row[f"measured_{key}"], row[f"simulated_{key}"] = mv, sv
            row[f"error_{key}"] = (sv - mv) / mv if mv and sv is not None else None
        out.append(row)
    return out


COLUMNS: list[Column] = [
    ("policy", lambda r: r["policy"]),
    ("load", lambda r: f"{r['concurrency']:g}"),
    ("requests", lambda r: str(r["requests"])),
    ("total tok/s", lambda r: fmt(r["total_tokens_per_s"], 1)),
    ("per-user tok/s", lambda r: fmt(r["user_tokens_per_s"], 1)),
    ("verify len", lambda r: fmt(r["avg_verify_len"])),
    ("tau", lambda r: fmt(r["acceptance_length"])),
    ("batch", lambda r: fmt(r["avg_batch_size"], 1)),
]


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.1f} %"


COMPARE_COLUMNS: list[Column] = [
    ("policy", lambda r: r["policy"]),
    ("concurrency", lambda r: f"{r['concurrency']:g}"),
    ("measured tok/s", lambda r: fmt(r["measured_total_tokens_per_s"], 2)),
    ("simulated tok/s", lambda r: fmt(r["simulated_total_tokens_per_s"], 2)),
    ("error", lambda r: _pct(r["error_total_tokens_per_s"])),
    ("measured tok/s/user", lambda r: fmt(r["measured_user_tokens_per_s"], 2)),
    ("simulated tok/s/user", lambda r: fmt(r["simulated_user_tokens_per_s"], 2)),
    ("error ", lambda r: _pct(r["error_user_tokens_per_s"])),
    ("measured verify len", lambda r: fmt(r["measured_avg_verify_len"])),
    ("simulated verify len", lambda r: fmt(r["simulated_avg_verify_len"])),
]


def rows_table(rows: Sequence[Mapping]) -> list[str]:
    return records_table(COLUMNS, rows)


def compare_table(rows: Sequence[Mapping]) -> list[str]:
    return records_table(COMPARE_COLUMNS, rows)


def write_report(rows: Sequence[Mapping], meta: Mapping, out_dir: str | Path, command: str = "",
                 comparison: Sequence[Mapping] = (), budget_with_anchor: bool = False) -> list[Path]:
    """simulate.json, simulate.md, throughput_vs_user_speed.png (Fig. 7), verify_budget.png (Fig. 8).

    ``budget_with_anchor`` plots 1 + verify length (tokens the target checks per request, the paper's Fig. 8
    axis, where MTP-1 verifies 2) instead of the draft tokens alone.
    """
    from dspark.evaluation.plots import plot_throughput_vs_user_speed, plot_verify_budget

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "simulate.json", out / "simulate.md"]
    paths[0].write_text(json.dumps({"command": command, "meta": meta, "rows": list(rows),
                                    "comparison": list(comparison)}, indent=1) + "\n", encoding="utf-8")
    lines = ["# Simulated serving load", "", f"Reproduce: `{command}`" if command else "", "",
             "Simulated by `dspark simulate` (src/dspark/simulate/): verify policy = the production "
             "`make_policy`; verify len = draft tokens verified per request-step; tau = tokens committed per "
             "request-step (bonus included); load = closed-loop users or Poisson requests/s.", "",
             *rows_table(rows)]
    if comparison:
        lines += ["", "## Simulated against measured", "", *compare_table(comparison)]
    paths[1].write_text("\n".join(lines) + "\n", encoding="utf-8")
    plotted = [dict(r) for r in rows if r["requests"]]
    if plotted:
        paths.append(plot_throughput_vs_user_speed(plotted, out / "throughput_vs_user_speed.png",
                                                   title="Serving throughput (simulated)"))
        budget = [r for r in plotted if r["avg_verify_len"] is not None]
        if budget_with_anchor:
            budget = [{**r, "avg_verify_len": 1 + r["avg_verify_len"]} for r in budget]
        title = "Verify budget: tokens verified per request (anchor included)" if budget_with_anchor \
            else "Verify budget (simulated)"
        paths.append(plot_verify_budget(budget, out / "verify_budget.png", title=title))
    return paths
