"""docs/serving/peers.md: `dspark serve` and vLLM's CPU build under the same load in the same run.

scripts/serving_peers.sh starts one server at a time (a *row*: an engine and a decoding method), drives it
with `dspark bench serve --url` into ``WORK/<row>/serve_load.json`` and notes the row in ``WORK/rows.jsonl``
(``note_row``: the server's command, how long it took to answer /health, the load average when the row
started and ended, or why the row was skipped or failed). ``write_peers`` joins the two into one table
(Markdown + JSON) and one throughput-vs-per-user-speed figure. Every ratio is against the vLLM plain row
of the same run at the same number of clients; ``matched_to_fixed1`` adds the drafting rows' per-user speed against
`dspark-fixed1` at the same total throughput (the issue's goal is stated at matched throughput).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Sequence

from dspark.tables import DASH, fmt, markdown_table

ROWS_FILE = "rows.jsonl"
BASELINE = "vllm-plain"  # the row every ratio is against
FIXED1 = "dspark-fixed1"  # the length-1 baseline of the matched-throughput comparison
#: a 1-minute load average at or above this, when a row started, means other work shared the CPUs
BUSY_LOAD = 0.5


def note_row(work: str | Path, record: dict) -> None:
    """Append one row's record (``name``, ``engine``, ``method``, ``status`` = measured | skipped | failed,
    and ``command``, ``reason``, ``ready_s``, ``load_before``, ``load_after`` where known); a later note of
    the same name replaces an earlier one."""
    if record.get("status") not in ("measured", "skipped", "failed"):
        raise ValueError(f"status must be measured, skipped or failed, got {record.get('status')!r}")
    path = Path(work) / ROWS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_rows(work: str | Path) -> list[dict]:
    """The noted rows in the order they were first noted, each with its measured ``points`` (the rows of
    ``WORK/<name>/serve_load.json``, by concurrency) when it was measured."""
    work = Path(work)
    rows: dict[str, dict] = {}
    for line in (work / ROWS_FILE).read_text().split("\n"):
        if line.strip():
            rec = json.loads(line)
            rows[rec["name"]] = rec
    for rec in rows.values():
        load = work / rec["name"] / "serve_load.json"
        rec["points"] = []
        if rec["status"] == "measured":
            if not load.is_file():
                raise ValueError(f"row {rec['name']} is noted as measured but {load} does not exist")
            rec["points"] = sorted(json.loads(load.read_text())["rows"], key=lambda p: p["concurrency"])
    return list(rows.values())


def add_ratios(rows: list[dict]) -> None:
    """Each point's total and per-user tokens/s as a ratio to the vLLM plain row's at the same concurrency
    (``total_vs_baseline``, ``user_vs_baseline``; None without that point)."""
    base = next((r for r in rows if r["name"] == BASELINE), None)
    by_c = {p["concurrency"]: p for p in base["points"]} if base else {}
    for row in rows:
        for p in row["points"]:
            b = by_c.get(p["concurrency"])
            for key, ratio in (("total_tokens_per_s", "total_vs_baseline"), ("user_tokens_per_s", "user_vs_baseline")):
                p[ratio] = p[key] / b[key] if b and b[key] and p["requests"] else None


def matched_to_fixed1(rows: Sequence[dict]) -> list[dict]:
    """Every point of each measured dspark row but ``FIXED1`` with ``FIXED1``'s per-user speed at the same total
    throughput (``fixed1_user_tokens_per_s``, linear between the two measured ``FIXED1`` points around it along its
    curve: ``dspark.simulate.report.user_speed_at``) and ``ratio`` = the row's per-user speed over it; both None
    where the row's throughput lies outside ``FIXED1``'s measured range (nothing is extrapolated). [] without a
    measured ``FIXED1`` row."""
    from dspark.simulate.report import user_speed_at

    if not any(r["name"] == FIXED1 and r["points"] for r in rows):
        return []
    points = [{**p, "policy": r["name"]} for r in rows for p in r["points"] if p["requests"]]
    out = []
    for r in rows:
        if r["engine"] != "dspark" or r["name"] == FIXED1:
            continue
        for p in r["points"]:
            if not p["requests"]:
                continue
            fixed1 = user_speed_at(points, FIXED1, p["total_tokens_per_s"])
            out.append({"row": r["name"], "concurrency": p["concurrency"], "total_tokens_per_s": p["total_tokens_per_s"],
                        "user_tokens_per_s": p["user_tokens_per_s"], "fixed1_user_tokens_per_s": fixed1,
                        "ratio": p["user_tokens_per_s"] / fixed1 if fixed1 else None})
    return out


def matched_markdown(matched: Sequence[dict]) -> list[str]:
    """The matched-throughput section of the page (nothing without matched points)."""
    if not matched:
        return []
    table = [[m["row"], str(m["concurrency"]), fmt(m["total_tokens_per_s"], 1), fmt(m["user_tokens_per_s"], 1),
              fmt(m["fixed1_user_tokens_per_s"], 1), _ratio(m["ratio"])] for m in matched]
    return [f"Per-user speed at matched throughput, against `{FIXED1}`: at each point of a row, `{FIXED1}`'s per-user "
            "speed at the same total throughput, linear between its two measured points around it on its curve "
            f"(clients ascending; – where the row's throughput is outside `{FIXED1}`'s measured range, nothing is "
            "extrapolated). A row ahead in throughput at the same clients is compared with `fixed:1` at more "
            "clients, where its per-user speed is lower: the paper's comparison (its Figure 7).", "",
            *markdown_table(["row", "clients", "total tok/s", "per-user tok/s",
                             f"`{FIXED1}` per-user at that total", "per-user vs it"], table), ""]


def _ratio(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f}x"


def _load(rec: dict) -> str:
    before, after = rec.get("load_before"), rec.get("load_after")
    return f"{fmt(before, 2)} -> {fmt(after, 2)}" if before is not None else DASH


def machine_busy(rows: Sequence[dict]) -> float | None:
    """The highest 1-minute load average at the start of a measured row, if it reaches ``BUSY_LOAD``."""
    loads = [r["load_before"] for r in rows if r["status"] == "measured" and r.get("load_before") is not None]
    return max(loads) if loads and max(loads) >= BUSY_LOAD else None


def peers_markdown(rows: list[dict], config: dict, command: str, full_command: str, smoke: bool,
                   figure: str = "peers.png") -> str:
    """The page: what ran (command, load, machine), the table, the rows not measured, the servers' commands."""
    busy = machine_busy(rows)
    cpus = config.get("cpu_count") or os.cpu_count()
    head = ["# Serving peers: `dspark serve` and vLLM's CPU build, same load, same run", ""]
    if smoke:
        head += [f"> **Smoke run{' under load' if busy is not None else ''}: not a result.** It checks that the "
                 f"script runs end to end, at a reduced size. Full run: `{full_command}`.", ""]
    elif busy is not None:
        head += [f"> Measured while other work ran on the machine (1-minute load average up to {busy:.2f} on "
                 f"{cpus} CPUs when a row started): the ratios are of this run, the absolute rates are not the "
                 "machine's.", ""]
    head += [
        f"Written by `{command}`.", "",
        f"One server at a time on 127.0.0.1, each started, its `/health` answered, one warm-up request sent, measured "
        f"and stopped, every one serving `{config['model']}` in bfloat16. The load is the same for every row: "
        f"`dspark bench serve --url http://127.0.0.1:PORT --concurrency {config['concurrency']} --num-requests "
        f"{config['num_requests']} --max-tokens {config['max_tokens']} --temperature "
        f"{config.get('temperature', 0):g}` (closed-loop clients "
        "streaming chat completions, the packaged evaluation prompts in the same order; at C clients max(C, "
        "requests) requests). Total = completion tokens of all requests / wall time; per-user = mean over "
        "requests of completion tokens / latency; tau = tokens committed per request-step, bonus included "
        "(dspark: every request-step, from its `/metrics`; vLLM: the request-steps that verified drafts, from its "
        "`spec_decode` counters; none for vLLM plain); draft ms = the drafter's time per step that drafted, verify "
        "ms = the verify pass and its host work per step (dspark's `/metrics`; prompt pieces that ride in a pass "
        "count in its time). Ratios are against the "
        f"`{BASELINE}` row at the same number of clients. {cpus} CPUs; "
        + (f"every server confined to core(s) {config['cpus']} (taskset, and vLLM's worker bound there by "
           "`VLLM_CPU_OMP_THREADS_BIND`)" if config.get("cpus") else
           "each engine placed on them as it chooses (vLLM binds its worker to one core and reserves the other)")
        + "; the 1-minute load average when each row started and ended is in the last column.", ""]
    add_ratios(rows)
    table = []
    for r in rows:
        for p in r["points"]:
            table.append([r["name"], r["engine"], r["method"], str(p["concurrency"]), str(p["requests"]),
                          fmt(p["total_tokens_per_s"], 1), _ratio(p["total_vs_baseline"]),
                          fmt(p["user_tokens_per_s"], 1), _ratio(p["user_vs_baseline"]),
                          fmt(p["acceptance_length"]), fmt(p.get("draft_ms"), 1), fmt(p.get("verify_ms"), 1),
                          str(p["errors"]), _load(r)])
    body = markdown_table(["row", "engine", "method", "clients", "requests", "total tok/s", "total vs vLLM plain",
                           "per-user tok/s", "per-user vs vLLM plain", "tau", "draft ms", "verify ms", "errors",
                           "load average"], table)
    body.append("")
    if any(p["requests"] for r in rows for p in r["points"]):  # write_peers draws the figure from these
        body += [f"![throughput against per-user speed]({figure})", ""]
    body += matched_markdown(matched_to_fixed1(rows))
    missing = [r for r in rows if r["status"] != "measured"]
    if missing:
        body += ["Rows not measured:", ""]
        body += [f"- `{r['name']}` ({r['status']}): {r.get('reason') or 'no reason noted'}" for r in missing]
        body.append("")
    servers = [[r["name"], f"`{r['command']}`", fmt(r.get("ready_s"), 0)] for r in rows if r.get("command")]
    if servers:
        body += ["Servers (`up` = seconds from start to a `/health` answer):", "",
                 *markdown_table(["row", "command", "up (s)"], servers), ""]
    return "\n".join(head + body)


def write_peers(work: str | Path, out_dir: str | Path, config: dict, command: str, full_command: str,
                smoke: bool) -> list[Path]:
    """peers.md, peers.json and peers.png in ``out_dir`` from the rows noted in ``work``."""
    from dspark.evaluation.plots import plot_throughput_vs_user_speed

    rows = read_rows(work)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = peers_markdown(rows, config, command, full_command, smoke)
    paths = [out / "peers.md", out / "peers.json"]
    paths[0].write_text(text)
    paths[1].write_text(json.dumps({"command": command, "full_command": full_command, "smoke": smoke,
                                    "config": config, "rows": rows, "matched_fixed1": matched_to_fixed1(rows)},
                                   indent=2) + "\n")
    points = [{**p, "policy": r["name"]} for r in rows for p in r["points"] if p["requests"]]
    if points:
        title = "Peers, same load" + (" (smoke run, not a result)" if smoke else "")
        paths.append(plot_throughput_vs_user_speed(points, out / "peers.png", title=title))
    return paths


def speculative_config(printed: str) -> str:
    """The ``--speculative-config`` JSON of the launch command `dspark export --to vllm` printed last."""
    lines = printed.strip().splitlines()
    argv = shlex.split(lines[-1]) if lines else []
    if "--speculative-config" not in argv:
        raise ValueError(f"no --speculative-config in the printed launch command: {printed[-400:]!r}")
    value = argv[argv.index("--speculative-config") + 1]
    json.loads(value)  # a printed command whose config is not JSON would only fail inside vLLM
    return value
