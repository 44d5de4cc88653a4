"""Markdown and JSON rendering of evaluation, calibration, sweep and ablation results.

Pure functions of the results dicts that ``runner``, ``sweep`` and
``reproduce`` write, and the files of an eval run (``write_results``,
``load_results``); no model code. ``docs_results_markdown`` assembles
``docs/reports/results-study.md`` from a reproduce run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from dspark.data.eval_sets import DISPLAY_NAMES
from dspark.errors import DSparkError
from dspark.tables import fmt, markdown_table


def clean_json(x: Any) -> Any:
    """NaN -> None, numpy/torch scalars -> float, tuples -> lists, recursively (strict JSON)."""
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float) or hasattr(x, "item"):
        x = float(x)
        return None if math.isnan(x) else x
    return x


# --------------------------------------------------------------------------- evaluation


def tau_table(results: Mapping[str, Any], key: str = "acceptance_length", digits: int = 2) -> list[str]:
    """Paper Table 1: rows drafters, columns benchmarks, domain macro averages, overall."""
    datasets = [d["name"] for d in results["datasets"]]
    domains = list(results["domains"])
    header = ["Drafter", *(DISPLAY_NAMES.get(n, n) for n in datasets), *(d.capitalize() for d in domains), "Overall"]
    rows = []
    for name, res in results["drafters"].items():
        row = [name, *(fmt(res["benchmarks"][n].get(key), digits) for n in datasets)]
        row += [_with_interval(res["domains"][d], key, digits) for d in domains]
        row.append(_with_interval(res["overall"], key, digits))
        rows.append(row)
    return markdown_table(header, rows, bold_best=True)


def _with_interval(summary: Mapping[str, Any], key: str, digits: int) -> str:
    """The value, and its 95 % bootstrap interval when the results carry one (``intervals.tau_intervals``)."""
    interval = summary.get(f"{key}_ci")
    value = fmt(summary.get(key), digits)
    return f"{value} [{fmt(interval[0], digits)}, {fmt(interval[1], digits)}]" if interval else value


def comparison_table(results: Mapping[str, Any], digits: int = 2) -> list[str]:
    """Paired differences of tau (``intervals.paired_difference``): overall and per domain, with intervals."""
    comparisons = results.get("comparisons") or []
    if not comparisons:
        return []
    domains = list(results["domains"])
    header = ["Drafter - baseline", *(d.capitalize() for d in domains), "Overall", "Verdict"]
    rows = []
    for c in comparisons:
        cells = []
        for d in [*domains, None]:
            part = c["overall"] if d is None else c["domains"].get(d)
            if not part or part.get("difference") is None:
                cells.append("-")
                continue
            lo_hi = part.get("interval")
            cells.append(f"{part['difference']:+.{digits}f}" + (
                f" [{lo_hi[0]:+.{digits}f}, {lo_hi[1]:+.{digits}f}]" if lo_hi else ""))
        verdict = "better" if c["better"] else "worse" if c["worse"] else "not distinguishable"
        rows.append([f"{c['drafter']} - {c['baseline']}", *cells, verdict])
    return markdown_table(header, rows)


def confidence_rows(results: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for name, res in results["drafters"].items():
        for bench, b in res["benchmarks"].items():
            conf = b.get("confidence") or {}
            for variant in ("raw", "sts"):
                c = conf.get(variant)
                if c:
                    rows.append([f"{name} ({variant})", DISPLAY_NAMES.get(bench, bench), fmt(c["ece_mean"], 4),
                                 fmt(c["auc_mean"], 3), fmt(c["brier_mean"], 4), str(c["count"])])
    return rows


def results_markdown(results: Mapping[str, Any], figures: Sequence[str | Path] = ()) -> str:
    """``results.md`` of an evaluation run."""
    s = results["settings"]
    counts = ", ".join(f"{DISPLAY_NAMES.get(d['name'], d['name'])} {d['num_samples']}" for d in results["datasets"])
    lines = [
        "# Offline evaluation",
        "",
        f"Target `{s.get('target')}`, temperature {s['temperature']}, at most {s['max_new_tokens']} new tokens, "
        f"seed {s['seed']}, batch size {s['batch_size']}, verify policy: {s.get('policy') or 'verify every draft'}.",
        f"Samples per benchmark: {counts}.",
        "",
        "## Acceptance length tau (bonus token included; higher is better)",
        "",
        *tau_table(results),
        "",
        "Per benchmark, tau pools every step of every sample. Domain columns are macro averages (unweighted mean "
        "over the domain's benchmarks); Overall is the unweighted mean over the domains. Brackets: 95 % bootstrap "
        "intervals over prompts.",
        "",
        *(["## Paired differences of tau (same prompts, paired bootstrap 95 % intervals)", "",
            *comparison_table(results), "", "A drafter is better than its baseline only when the overall interval "
            "lies above 0.", ""] if results.get("comparisons") else []),
        "## Verify rate (committed tokens per verified position)",
        "",
        *tau_table(results, "verify_rate", 3),
        "",
        "## Per-position conditional acceptance (domain macro, draft positions 1..K)",
        "",
    ]
    for name, res in results["drafters"].items():
        for dom, summary in res["domains"].items():
            lines.append(f"- {name}, {dom}: " + " ".join(fmt(x) for x in summary["per_position_acceptance"]))
    conf = confidence_rows(results)
    if conf:
        lines += ["", "## Confidence head (cumulative survival vs 'all drafts so far accepted')", "",
                  "Count-weighted means over draft positions; ECE over 20 equal-width bins.", "",
                  *markdown_table(["Drafter", "Benchmark", "ECE", "AUROC", "Brier", "predictions"], conf)]
    if figures:
        lines += ["", "## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- evaluation files


def write_results(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """results.json, results.md and one acceptance-curve PNG per domain (paper Fig. 2)."""
    from dspark.evaluation.plots import plot_acceptance_curves

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for dom in results["domains"]:
        curves = {name: res["domains"][dom]["per_position_acceptance"] for name, res in results["drafters"].items()}
        curves = {n: c for n, c in curves.items() if c}  # a drafter that never proposed plots no points
        if curves:
            figures.append(plot_acceptance_curves(curves, out / f"acceptance_{dom}.png",
                                                  title=f"Per-position conditional acceptance: {dom}"))
    (out / "results.json").write_text(json.dumps(results, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (out / "results.md").write_text(results_markdown(results, [str(f) for f in figures]), encoding="utf-8")
    return [out / "results.json", out / "results.md", *figures]


def load_results(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise DSparkError(f"{path} does not exist; run `dspark eval` first")
    return json.loads(path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- calibration


def calibration_markdown(report: Mapping[str, Any], figure: str | Path | None = None) -> str:
    """``calibration.md``: per-position ECE / AUROC / Brier before and after STS."""
    before, after = report["before"], report["after"]
    rows = []
    for b, a, t in zip(before["per_position"], after["per_position"], report["temperatures"]):
        rows.append([str(b["position"] + 1), str(b["count"]), f"{t:.3g}", fmt(b["ece"], 4), fmt(a["ece"], 4),
                     fmt(b["auroc"], 3), fmt(a["auroc"], 3), fmt(b["brier"], 4), fmt(a["brier"], 4)])
    rows.append(["mean", str(before["count"]), "", fmt(before["ece_mean"], 4), fmt(after["ece_mean"], 4),
                 fmt(before["auc_mean"], 3), fmt(after["auc_mean"], 3), fmt(before["brier_mean"], 4),
                 fmt(after["brier_mean"], 4)])
    lines = [
        "# Confidence calibration (sequential temperature scaling)",
        "",
        f"Drafter `{report.get('drafter')}`, target `{report.get('target')}`; {report['num_prompts']} held-out "
        f"prompts ({', '.join(report['datasets'])}), {report['num_steps']} speculative steps. "
        f"ECE over {report['n_bins']} equal-width bins of the cumulative survival prod_(j<=k) sigmoid(logit_j / T_j) "
        "against the label 'drafts 1..k all accepted'. STS keeps the order of confidences at each position, so "
        "position 1's AUROC is unchanged; later survivals multiply positions with different temperatures and "
        "may reorder slightly.",
        f"Held-out data: {report['heldout']}. 'after' is measured on the same data the temperatures were fitted on.",
        "",
        *markdown_table(["Position", "count", "T_k", "ECE before", "ECE after", "AUROC before", "AUROC after",
                         "Brier before", "Brier after"], rows),
        "",
        f"STS file (SGLang format): `{report.get('sts_path')}`.",
    ]
    if figure:
        lines += ["", f"![reliability diagram]({Path(figure).name})"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- threshold sweep


SWEEP_HEADER = ["Drafter", "Domain", "Threshold", "Verified/step", "Accepted/step", "Rejected/step",
                "Acceptance rate", "tau"]


def sweep_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    table = [[r["drafter"], r["domain"], f"{r['threshold']:g}", fmt(r["verified_per_step"]),
              fmt(r["accepted_per_step"]), fmt(r["rejected_per_step"]), fmt(r["acceptance_rate"], 3),
              fmt(r["acceptance_length"])] for r in rows]
    return markdown_table(SWEEP_HEADER, table)


def sweep_markdown(rows: Sequence[Mapping[str, Any]], definition: str, figure: str | Path | None = None) -> str:
    lines = ["# Static confidence-threshold sweep", "", definition + ".", "", *sweep_table(rows)]
    if figure:
        lines += ["", f"![threshold sweep]({Path(figure).name})"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- ablations


def ablation_table(rows: Sequence[Mapping[str, Any]], x_name: str) -> list[str]:
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    keys = list(dict.fromkeys((r["series"], r["x"]) for r in rows))
    value = {(r["series"], r["x"], r["domain"]): r["acceptance_length"] for r in rows}
    table = [[series, str(x), *(fmt(value.get((series, x, d))) for d in domains)] for series, x in keys]
    return markdown_table(["Drafter", x_name, *(d.capitalize() for d in domains)], table)


def plot_ablation(rows: Sequence[Mapping[str, Any]], path: str | Path, x_label: str, title: str) -> Path:
    """Paper Fig. 3 / 4: tau against depth or block size, one panel per domain, one line per series."""
    from dspark.extras import require

    matplotlib = require("matplotlib", "plots", "drawing figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(dict.fromkeys(r["domain"] for r in rows))
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.6), squeeze=False)
    for ax, dom in zip(axes[0], domains):
        for series in dict.fromkeys(r["series"] for r in rows):
            pts = sorted((r["x"], r["acceptance_length"]) for r in rows
                         if r["domain"] == dom and r["series"] == series and r["acceptance_length"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=series)
        ax.set(xlabel=x_label, ylabel="acceptance length tau", title=dom)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- docs/reports/results-study.md


def _budget_value(v: Any) -> str:
    if v is None:
        return "all (DeepSpec caps)"
    if isinstance(v, (list, tuple)):
        return ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v) or "none"
    return f"{v:g}" if isinstance(v, float) else str(v)


def docs_results_markdown(
    command: str,
    budget: Mapping[str, Any],
    main: Mapping[str, Any] | None,
    calibration: Mapping[str, Mapping[str, Any]],
    sweep_rows: Sequence[Mapping[str, Any]],
    ablations: Mapping[str, tuple[str, list[dict[str, Any]]]],
    figures: Mapping[str, str],
    notes: Sequence[str] = (),
) -> str:
    """``docs/reports/results-study.md`` of a reproduce run; ``figures`` maps a caption to a path relative to the page."""
    lines = [
        "# Results",
        "",
        "Generated by the command below from the JSON files it writes; do not edit by hand.",
        "",
        "```",
        command,
        "```",
        "",
        "Budget:",
        "",
        *markdown_table(["setting", "value"], [[k, _budget_value(v)] for k, v in budget.items()]),
        *([""] + [f"- {n}" for n in notes] if notes else []),
        "",
    ]
    if main:
        s = main["settings"]
        counts = ", ".join(f"{DISPLAY_NAMES.get(d['name'], d['name'])} {d['num_samples']}" for d in main["datasets"])
        lines += [
            "## Acceptance length tau (paper Table 1)",
            "",
            f"Target `{s.get('target')}`, temperature {s['temperature']}, at most {s['max_new_tokens']} new tokens, "
            f"every draft verified. Samples: {counts}. tau counts the bonus token; domain columns are macro "
            "averages over their benchmarks, Overall the mean over domains.",
            "",
            *tau_table(main),
            "",
        ]
        conf = confidence_rows(main)
        if conf:
            lines += ["### Confidence head on the evaluation sets", "",
                      *markdown_table(["Drafter", "Benchmark", "ECE", "AUROC", "Brier", "predictions"], conf), ""]
    for name, report in calibration.items():
        b, a = report["before"], report["after"]
        lines += [
            f"## STS calibration: {name} (paper Fig. 6)",
            "",
            f"Held-out: {report['heldout']} ({report['num_steps']} steps). Temperatures "
            + ", ".join(f"{t:.3g}" for t in report["temperatures"]) + ".",
            "",
            *markdown_table(["", "ECE", "AUROC", "Brier"], [
                ["before STS", fmt(b["ece_mean"], 4), fmt(b["auc_mean"], 3), fmt(b["brier_mean"], 4)],
                ["after STS", fmt(a["ece_mean"], 4), fmt(a["auc_mean"], 3), fmt(a["brier_mean"], 4)],
            ]),
            "",
        ]
    if sweep_rows:
        lines += ["## Static confidence-threshold sweep (paper Fig. 5)", "", *sweep_table(sweep_rows), ""]
    for title, (x_name, rows) in ablations.items():
        lines += [f"## {title}", "", *ablation_table(rows, x_name), ""]
    if figures:
        lines += ["## Figures", ""]
        for caption, rel in figures.items():
            lines += [f"**{caption}**", "", f"![{caption}]({rel})", ""]
    return "\n".join(lines).rstrip() + "\n"
