"""Figures in the style of the paper (matplotlib, Agg backend, PNG files).

Every function takes plain Python data (lists / dicts / arrays), writes one PNG
to ``path`` (creating its folder) and returns the path. Row-based functions
take a list of dicts; the keys each one needs are listed in its docstring.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from dspark.extras import require

matplotlib = require("matplotlib", "plots", "drawing figures")  # callers import this module when they draw
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dspark.evaluation.metrics import DEFAULT_ECE_BINS, ArrayLike, ece, reliability_bins  # noqa: E402

Row = Mapping[str, Any]


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def _group(rows: Sequence[Row], key: str) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        groups[str(row[key])].append(row)
    return dict(groups)


def _grid(n: int, width: float = 4.5, height: float = 3.6) -> tuple[plt.Figure, list[plt.Axes]]:
    ncols = min(3, max(n, 1))
    nrows = math.ceil(max(n, 1) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.axis("off")
    return fig, flat[:n]


def plot_acceptance_curves(
    curves: Mapping[str, Sequence[float | None]],  # name -> conditional acceptance at draft positions 1..K
    path: str | Path,
    title: str = "Per-position acceptance",
) -> Path:
    """Paper Fig. 2: conditional acceptance per draft position, one line per domain/drafter."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in curves.items():
        ys = [math.nan if v is None else v for v in values]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set(xlabel="draft position", ylabel="conditional acceptance rate", ylim=(0, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_reliability(
    labels: Sequence[ArrayLike],  # K arrays (n_k,): label of position k (drafts 0..k accepted)
    preds: Mapping[str, Sequence[ArrayLike]],  # e.g. {"before STS": K arrays, "after STS": K arrays}
    path: str | Path,
    n_bins: int = DEFAULT_ECE_BINS,
    title: str = "Confidence reliability",
) -> Path:
    """Paper Fig. 6: reliability diagram per draft position, diagonal = perfect calibration.

    ``metrics.survival_by_position`` gives the (pred, label) pairs, once with
    temperatures=None and once with the fitted STS temperatures.
    """
    fig, axes = _grid(len(labels))
    for k, ax in enumerate(axes):
        ax.plot([0, 1], [0, 1], "--", color="0.6", linewidth=1)
        for name, per_position in preds.items():
            bins = reliability_bins(per_position[k], labels[k], n_bins)
            filled = bins.count > 0
            err = ece(per_position[k], labels[k], n_bins)
            label = f"{name} (ECE {err:.3f})"
            ax.plot(bins.pred_mean[filled], bins.label_mean[filled], "o-", markersize=3, label=label)
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {k + 1}", xlabel="predicted survival", ylabel="observed")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_threshold_sweep(rows: Sequence[Row], path: str | Path, title: str = "Static confidence threshold") -> Path:
    """Paper Fig. 5, one panel per domain.

    Row keys: ``domain``, ``threshold``, ``verified_per_step`` (draft tokens
    verified per step), ``accepted_per_step``, and optionally
    ``acceptance_rate`` (default accepted / verified).
    """
    groups = _group(rows, "domain")
    fig, axes = _grid(len(groups))
    for ax, (domain, group) in zip(axes, groups.items()):
        group = sorted(group, key=lambda r: r["threshold"])
        xs = [r["threshold"] for r in group]
        verified = [r["verified_per_step"] for r in group]
        accepted = [r["accepted_per_step"] for r in group]
        rejected = [v - a for v, a in zip(verified, accepted)]
        rate = [r.get("acceptance_rate", a / v if v else math.nan) for r, a, v in zip(group, accepted, verified)]
        width = 0.8 * min((b - a for a, b in zip(xs, xs[1:])), default=0.1)
        ax.bar(xs, accepted, width=width, label="accepted", color="C2")
        ax.bar(xs, rejected, width=width, bottom=accepted, label="rejected", color="C3", alpha=0.7)
        ax.set(xlabel="confidence threshold", ylabel="draft tokens verified / step", title=domain)
        twin = ax.twinx()
        twin.plot(xs, rate, "k-o", markersize=3, label="acceptance rate")
        twin.set(ylabel="acceptance rate", ylim=(0, 1.02))
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_throughput_vs_user_speed(rows: Sequence[Row], path: str | Path, title: str = "Serving throughput") -> Path:
    """Paper Fig. 7. Row keys: ``policy``, ``concurrency``, ``user_tokens_per_s``, ``total_tokens_per_s``."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for policy, group in _group(rows, "policy").items():
        group = sorted(group, key=lambda r: r["concurrency"])
        xs = [r["user_tokens_per_s"] for r in group]
        ys = [r["total_tokens_per_s"] for r in group]
        ax.plot(xs, ys, marker="o", label=policy)
        for r, x, y in zip(group, xs, ys):
            ax.annotate(str(r["concurrency"]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set(xlabel="per-user tokens/s", ylabel="aggregate tokens/s", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_verify_budget(rows: Sequence[Row], path: str | Path, title: str = "Verify budget") -> Path:
    """Paper Fig. 8. Row keys: ``policy``, ``concurrency``, ``avg_verify_len`` (tokens verified per request-step)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, group in _group(rows, "policy").items():
        group = sorted(group, key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in group], [r["avg_verify_len"] for r in group], marker="o", label=policy)
    ax.set(xscale="log", xlabel="concurrency", ylabel="average verify length", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
