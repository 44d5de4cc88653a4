"""`dspark bench speed`: the Markdown report, rendered from the JSON: ``OUT/speed.md`` (the whole report of one
run) and one section of the shared page ``--doc`` (docs/reports/performance.md: one section per setting, each
keyed by its ``--out-dir``, so a rerun replaces its own section and leaves the others as they are)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspark.data.eval_sets import DISPLAY_NAMES
from dspark.bench.speed_methods import HF_PLAIN, OURS_PLAIN, greedy_reference
from dspark.tables import Column, fmt, markdown_table, records_table


# (column title, row -> cell text); the greedy-match column is inserted before the memory columns at T = 0
_COLUMNS: list[Column] = [
    ("method", lambda r: r["method"]),
    ("k", lambda r: str(r["block_size"] or "")),
    ("tok/s", lambda r: fmt(r["tokens_per_s"], 1)),
    ("× hf-generate", lambda r: fmt(r["x_hf_generate"])),
    ("× ours-plain", lambda r: fmt(r["x_ours_plain"])),
    ("τ", lambda r: fmt(r.get("tau"))),
    ("draft ms/step", lambda r: fmt(r.get("draft_ms"), 1)),
    ("verify ms/step", lambda r: fmt(r.get("verify_ms"), 1)),
    ("ideal ×", lambda r: fmt(r.get("ideal_speedup"))),
    ("decode ×", lambda r: fmt(r.get("x_ours_plain_decode"))),
    ("efficiency", lambda r: fmt(r.get("efficiency"))),
]
_MEMORY_COLUMNS: list[Column] = [
    ("peak RSS MiB", lambda r: fmt(r["peak_rss_mib"], 0)),
    ("+RSS MiB", lambda r: fmt(r["extra_rss_mib"], 0)),
]


def _greedy_cell(r: dict) -> str:
    gm = r.get("greedy_match")
    return f"{gm[0]}/{gm[1]}" if gm else fmt(None)


def _table(rows: list[dict], temperature: float, reference: str) -> list[str]:
    columns = list(_COLUMNS)
    if temperature == 0:
        columns.append(("greedy = plain", _greedy_cell))
    columns += _MEMORY_COLUMNS
    return records_table(columns, [r for r in rows if r["temperature"] == temperature])


def _per_set_table(result: dict[str, Any], temperature: float, reference: str) -> list[str]:
    """tok/s of each row over the reference's, per evaluation set (from the per-call records)."""
    records = [r for r in result.get("records", []) if r["temperature"] == temperature]
    sets = list(dict.fromkeys(r["dataset"] for r in records))
    if len(sets) < 2:
        return []
    tok: dict[tuple[str, str], list[float]] = {}
    for r in records:
        acc = tok.setdefault((r["method"], r["dataset"]), [0.0, 0.0])
        acc[0] += r["new_tokens"]
        acc[1] += r["seconds"]
    rate = {k: v[0] / v[1] for k, v in tok.items() if v[1] > 0}
    table = [[method, *(fmt(rate[(method, s)] / rate[(reference, s)]) if (method, s) in rate and (reference, s) in rate
                        else fmt(None) for s in sets)]
             for method in dict.fromkeys(r["method"] for r in records)]
    return [f"Per set (× {reference}, tok/s over its tok/s on the same prompts):", "",
            *markdown_table(["method", *(DISPLAY_NAMES.get(s, s) for s in sets)], table), ""]


FORMULAS = """\
- **tok/s** = Σ new tokens / Σ wall seconds of the `generate` calls (batch size 1, prefill included).
- **× hf-generate**, **× ours-plain**: tok/s over that row's tok/s at the same temperature.
- **τ** (acceptance length) = tokens committed per speculative step, bonus token included (our engine only).
- **draft / verify ms/step**: mean time per step in `drafter.propose`, and in the target's verify forward plus
  rejection sampling (`SpeculativeGenerator.timings`); medians are in the JSON.
- **ideal ×** = τ · t_AR / (t_draft + t_verify), with t_AR = ours-plain's mean step time (one target forward of
  one token). This is eq. (1) of the paper (latency per token L = (T_draft + T_verify) / τ) taken as
  L_AR / L_spec: the speedup the measured acceptance and the measured draft and verify costs imply if nothing
  else took time. Means (not medians) make it exactly the ratio of in-loop time per token.
- **decode ×**: the speedup over ours-plain in the decode phase only: tokens after the first / wall seconds from
  the first speculative step to the end of the call (prefill and the first token, which every method shares,
  excluded; they pull the end-to-end ratios towards 1 on short outputs).
- **efficiency** = decode × / ideal ×: how much of the ideal the decode loop realises. Below 1 is time outside
  draft + verify (bookkeeping, committing tokens, Python overhead); a little above 1 is timing noise.
- **greedy = plain**: prompts whose greedy output equals plain decoding's token for token: ours-plain's for our
  drafting rows (lossless decoding must give 100 %), hf-generate's for transformers' rows and for ours-plain
  (our implementation against theirs); a mismatch is listed as set#sample@first differing position.
- **peak RSS**: the largest resident-set high-water mark over the row's calls. Method: {memory}.
- **+RSS**: that peak minus the RSS just before the call, i.e. what the call itself allocated (KV caches,
  activations). Every model of the run stays loaded in the one process, so peak RSS includes all of them;
  **drafter MiB** (below) is the drafter's own weights.
"""


BF16_MISMATCH = (
    "In bfloat16 such differences are rounding, not lost losslessness: a one-token step and a block of tokens "
    "multiply with different shapes, and transformers' kernels differ from ours, so a near-tied greedy choice can "
    "flip, after which the texts diverge. Our rows compute a one-token step as a verify block computes its rows "
    "on CPUs where that makes them bitwise equal (`TargetModel.make_batch_invariant`; the test suite checks "
    "exact greedy equality for every drafter).")


def render_markdown(result: dict[str, Any], title: str = "Decoding speed", raw_json: str | None = None,
                    level: int = 1, definitions: bool = True) -> str:
    """The report of one run under a heading of ``level`` (its parts one level below); ``definitions``: with the
    column definitions (a page of several runs states them once, ``definitions_markdown``)."""
    cfg, mach, rows = result["config"], result["machine"], result["rows"]
    h1, h2 = "#" * level, "#" * (level + 1)
    reference = HF_PLAIN if any(r["method"] == HF_PLAIN for r in rows) else OURS_PLAIN
    sets = ", ".join(DISPLAY_NAMES.get(s, s) for s in cfg["sets"])
    lines = [
        f"{h1} {title}", "",
        f"Reproduce: `{result['command']}`" if result.get("command") else "", "",
        f"Target `{cfg['target']}`; {result['num_prompts']} prompt(s) ({cfg['per_set']} from each of {sets}; first "
        f"turn through the chat template), batch size 1, up to {cfg['max_new_tokens']} new tokens, "
        f"{cfg.get('dtype', 'float32')}"
        + (" (HF rows too)" if cfg.get("dtype", "float32") != "float32" and cfg.get("include_hf", True) else "")
        + ("; '+compile' rows use a torch.compile'd target" if cfg.get("compile") else "")
        + (f"; on {mach.get('gpu') or 'a GPU'}" if cfg.get("device", "cpu") != "cpu" else "") + ".",
        f"Machine: {mach.get('cpu_model') or mach.get('machine')}, {mach.get('cpu_count')} CPUs, "
        f"{mach.get('memory_gib')} GiB; {mach.get('torch_threads')} torch threads; {mach.get('platform')}; "
        f"Python {mach.get('python')}, torch {mach.get('torch')}, transformers {mach.get('transformers')}"
        + (f"; load average at start {mach['load_average']}" if mach.get("load_average") else "") + ".",
        f"Run at {result.get('started')} and took {fmt(result.get('wall_s'), 0)} s."
        + (f" Raw results: `{raw_json}`." if raw_json else ""), "",
    ]
    for temperature in cfg["temperatures"]:
        label = "Greedy (temperature 0)" if temperature == 0 else f"Temperature {temperature:g} (seeded sampling)"
        lines += [f"{h2} {label}", ""] + _table(rows, temperature, reference) + [""]
        lines += _per_set_table(result, temperature, reference)
        bad = [r for r in rows if r["temperature"] == temperature and r.get("mismatches")]
        for r in bad:
            lines.append(f"- {r['method']} differs from {greedy_reference(r['method'])} on "
                         f"{', '.join(r['mismatches'])}.")
        if bad:
            lines.append("")
            if cfg.get("dtype", "float32") != "float32" and temperature == 0:
                lines += [BF16_MISMATCH, ""]
    notes = [f"- {r['method']}: {r['note']}" for r in rows if r["note"] and r["temperature"] == cfg["temperatures"][0]]
    weights = [f"{r['method']}{'@k' + str(r['block_size']) if r['block_size'] else ''} {r['drafter_weights_mib']:.0f}"
               for r in rows if r["drafter_weights_mib"] and r["temperature"] == cfg["temperatures"][0]]
    if definitions:
        lines += [f"{h2} Definitions", "", definitions_markdown(result), ""]
    if notes or weights:
        lines += [f"{h2} Settings", ""] + notes + ([f"- drafter MiB: {', '.join(weights)}"] if weights else []) + [""]
    if cfg.get("drafters"):
        lines += ["Drafter checkpoints: " + ", ".join(f"`{n}` = `{p}`" for n, p in cfg["drafters"]), ""]
    if cfg.get("draft_lm"):
        lines += [f"Draft LM: `{cfg['draft_lm']}`", ""]
    return "\n".join(lines) + "\n"


def definitions_markdown(result: dict[str, Any]) -> str:
    return FORMULAS.format(memory=result.get("memory_method", "")).rstrip()


PAGE_TITLE = "Performance: single-request decoding speed"
DEFINITIONS_KEY = "definitions"


def _markers(key: str) -> tuple[str, str]:
    return f"<!-- dspark bench speed: {key} -->", f"<!-- /dspark bench speed: {key} -->"


def section_body(page: str, key: str) -> str | None:
    """The text between the markers of section ``key`` of a page (None when the page has no such section)."""
    start, end = _markers(key)
    i = page.find(start)
    j = page.find(end, i + len(start)) if i >= 0 else -1
    return page[i + len(start):j].strip() if j >= 0 else None


def replace_section(page: str, key: str, body: str) -> str:
    """``page`` with section ``key`` replaced by ``body``; a new section goes before the definitions (or last)."""
    start, end = _markers(key)
    block = f"{start}\n{body.strip()}\n{end}"
    if section_body(page, key) is not None:
        i = page.find(start)
        j = page.find(end, i + len(start))
        return page[:i] + block + page[j + len(end):]
    before = page.find(_markers(DEFINITIONS_KEY)[0])
    if before >= 0 and key != DEFINITIONS_KEY:
        return page[:before] + block + "\n\n" + page[before:]
    return page.rstrip() + "\n\n" + block + "\n"


def write_section(doc: str | Path, result: dict[str, Any], key: str, raw_json: str, title: str | None = None) -> Path:
    """Write this run into its section ``key`` of the page ``doc`` (created with its title when missing), under
    ``title`` (default: the section's present heading, else ``key``), and the shared definitions."""
    doc_path = Path(doc)
    page = doc_path.read_text(encoding="utf-8") if doc_path.exists() else f"# {PAGE_TITLE}\n"
    old = section_body(page, key)
    if title is None:
        title = old.splitlines()[0].lstrip("#").strip() if old else key
    page = replace_section(page, key, render_markdown(result, title, raw_json, level=2, definitions=False))
    page = replace_section(page, DEFINITIONS_KEY, "## Definitions\n\n" + definitions_markdown(result))
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    doc_path.write_text(page, encoding="utf-8")
    return doc_path


def write_outputs(result: dict[str, Any], out_dir: str | Path, doc: str | None,
                  doc_title: str | None = None) -> list[Path]:
    """OUT/speed.json, OUT/speed.md and, with ``doc``, the run's section of that page (keyed by ``out_dir``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "speed.json", out / "speed.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(render_markdown(result))
    if doc:
        paths.append(write_section(doc, result, out.as_posix(), str(paths[0]), doc_title))
    return paths
