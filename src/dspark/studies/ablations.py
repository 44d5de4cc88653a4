"""The drafter ablations: depth (paper Fig. 3) and draft length (paper Fig. 4).

The series (which drafters, trained how, plotted where) are shared by ``dspark reproduce --ablations`` and the
reduced ablation run of ``scripts/ablation.py``: every drafter of one ablation is trained on a study's feature
cache for the same wall-clock budget with one thread, then all are evaluated together on a few samples per
benchmark, and ``docs/reports/ablation-<kind>.md`` with ``docs/reports/figures/ablation_<kind>.png`` is written. The run is
resumable: finished trainings are kept (``--resume``) and the evaluation resumes per sample.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dspark.errors import DSparkError
from dspark.training.checkpoints import LATEST  # the trainer's symlink to its newest checkpoint

DEPTHS = (1, 2, 3, 4, 5)  # Fig. 3, block size 7
DEPTH_BASELINE_LAYERS = 5  # Fig. 3 compares with a 5-layer DFlash
BLOCK_SIZES = (3, 7, 11, 15)  # Fig. 4: gamma; draft length (gamma + anchor) 4, 8, 12, 16
DEPTH_KEY = "model.num_draft_layers"
BLOCK_KEY = "model.block_size"


@dataclass(frozen=True)
class Series:
    """One ablation drafter: how it is trained and where it sits on the figure."""

    name: str
    preset: str
    kind: str
    overrides: tuple[str, ...]
    series: str  # legend entry
    x: int  # depth, or draft length gamma + 1


def depth_series() -> list[Series]:
    rows = [Series(f"dspark-L{d}", "smollm2-dspark-markov", "dspark", (f"{DEPTH_KEY}={d}", f"{BLOCK_KEY}=7"),
                   "DSpark (Markov)", d) for d in DEPTHS]
    rows.append(Series(f"dflash-L{DEPTH_BASELINE_LAYERS}", "smollm2-dflash", "dflash",
                       (f"{DEPTH_KEY}={DEPTH_BASELINE_LAYERS}", f"{BLOCK_KEY}=7"),
                       f"DFlash ({DEPTH_BASELINE_LAYERS} layers)", DEPTH_BASELINE_LAYERS))
    return rows


def block_series(layers: int) -> list[Series]:
    kinds = (("markov", "smollm2-dspark-markov", "dspark", "DSpark (Markov)"),
             ("rnn", "smollm2-dspark-rnn", "dspark", "DSpark (RNN)"),
             ("dflash", "smollm2-dflash", "dflash", "DFlash"))
    return [Series(f"{short}-g{g}", preset, kind, (f"{BLOCK_KEY}={g}", f"{DEPTH_KEY}={layers}"), label, g + 1)
            for short, preset, kind, label in kinds for g in BLOCK_SIZES]


def ablation_rows(results: dict[str, Any] | None, series: Sequence[Series]) -> list[dict[str, Any]]:
    """Rows {series, x, domain, acceptance_length} (domain 'overall' too) of the drafters of ``series``."""
    if not results:
        return []
    by_name = {s.name: s for s in series}
    rows = []
    for name, res in results["drafters"].items():
        s = by_name.get(name)
        if s is None:
            continue
        for dom, summary in res["domains"].items():
            rows.append({"series": s.series, "x": s.x, "domain": dom,
                         "acceptance_length": summary["acceptance_length"]})
        rows.append({"series": s.series, "x": s.x, "domain": "overall",
                     "acceptance_length": res["overall"]["acceptance_length"]})
    return rows


# --------------------------------------------------------------------------- the reduced run (scripts/ablation.py)


@dataclass(frozen=True)
class AblationKind:
    series: Callable[[int], list[Series]]  # draft layers -> the drafters
    x_label: str
    title: str
    what: str  # what is held fixed, for the page


KINDS: dict[str, AblationKind] = {
    "depth": AblationKind(lambda layers: depth_series(), "layers", "Drafter depth at block size 7 (Fig. 3)",
                          "DSpark (Markov head) with 1-5 draft layers and a 5-layer DFlash, block size 7"),
    "block": AblationKind(block_series, "draft length (gamma + 1)",
                          "Draft length: Markov / RNN head vs DFlash (Fig. 4)",
                          "DSpark (Markov and RNN heads) and DFlash at gamma = 3, 7, 11, 15 (draft lengths 4, 8, 12, 16)"),
}


@dataclass(frozen=True)
class ReducedAblation:
    """Settings of one reduced ablation run (the flags of ``scripts/ablation.py``)."""

    kind: str  # a key of KINDS
    budget_s: float = 150  # training wall-clock seconds per drafter
    limit: int = 1  # evaluation samples per benchmark
    layers: int = 1  # draft layers in the block-size ablation
    max_new_tokens: int = 128
    dtype: str = "bfloat16"  # training compute dtype (fp32 master weights either way)
    study: Path = Path("runs/study")  # output of `dspark reproduce --budget cpu`
    dspark: str = str(Path(sys.executable).with_name("dspark"))  # the dspark executable

    @property
    def out(self) -> Path:
        return Path(self.study) / f"ablation-{self.kind}"

    @property
    def command(self) -> str:
        """The scripts/ablation.py command that reruns this ablation."""
        rerun = (f"python scripts/ablation.py {self.kind} --budget-s {self.budget_s:g} --limit {self.limit} "
                 f"--dtype {self.dtype}")
        return rerun + (f" --layers {self.layers}" if self.kind == "block" else "")


def check_same_settings(run: Path, cfg: ReducedAblation) -> None:
    """Resuming is for interrupted runs: refuse a folder trained with another budget or dtype."""
    saved = run / LATEST / "train_config.json"
    if not saved.is_file():
        return
    trained = json.loads(saved.read_text(encoding="utf-8"))
    if (trained.get("time_budget_s"), trained.get("dtype")) != (cfg.budget_s, cfg.dtype):
        raise DSparkError(f"{run} was trained with time_budget_s={trained.get('time_budget_s')}, "
                          f"dtype={trained.get('dtype')}; delete {run.parent.parent} to rerun with "
                          f"--budget-s {cfg.budget_s:g} --dtype {cfg.dtype}")


def ablation_commands(cfg: ReducedAblation) -> list[list[str]]:
    """The `dspark train` command of every drafter of the ablation, then the one `dspark eval` of all of them."""
    study, out = Path(cfg.study), cfg.out
    common = ["--set", f"data={study / 'tok'}", "--set", "feature_source=cache",
              "--set", f"cache_dir={study / 'data' / 'features'}", "--set", "max_length=512",
              "--set", "epochs=10", "--set", "num_threads=1", "--set", f"time_budget_s={cfg.budget_s:g}",
              "--set", f"dtype={cfg.dtype}"]
    commands, drafters = [], []
    for s in KINDS[cfg.kind].series(cfg.layers):
        run = out / "train" / s.name
        cmd = [cfg.dspark, "train", "--config", s.preset, "--drafter", s.kind, "--out", str(run), "--resume",
               *common]
        for o in s.overrides:
            cmd += ["--set", o]
        commands.append(cmd)
        drafters += ["--drafter", f"{s.name}={run / LATEST}"]
    commands.append([cfg.dspark, "--threads", "1", "eval", "--datasets", "all", "--limit", str(cfg.limit),
                     "--max-new-tokens", str(cfg.max_new_tokens), "--out", str(out / "eval"), "--no-progress",
                     *drafters])
    return commands


def write_ablation_doc(cfg: ReducedAblation, docs: Path = Path("docs/reports")) -> tuple[Path, Path]:
    """DOCS/ablation-<kind>.md and DOCS/figures/ablation_<kind>.png (DOCS: docs/reports) from the run's results and training summaries."""
    from dspark.evaluation.report import plot_ablation
    from dspark.tables import markdown_table

    kind, out = KINDS[cfg.kind], cfg.out
    series = kind.series(cfg.layers)
    results = json.loads((out / "eval" / "results.json").read_text(encoding="utf-8"))
    fig = docs / "figures" / f"ablation_{cfg.kind}.png"
    plot_ablation(ablation_rows(results, series), fig, kind.x_label, kind.title)
    table = (out / "eval" / "results.md").read_text(encoding="utf-8").split("\n", 1)[1]
    budget_rows = []
    for s in series:
        summary = json.loads((out / "train" / s.name / "train_summary.json").read_text(encoding="utf-8"))
        budget_rows.append([s.name, str(summary["steps"]), f"{summary['tokens_seen']:.0f}",
                            f"{summary['tokens_per_s']:.0f}"])
    table += ("\n## Training budget actually used\n\n"
              + "\n".join(markdown_table(["Drafter", "steps", "tokens seen", "train tok/s"], budget_rows)) + "\n")
    doc = docs / f"ablation-{cfg.kind}.md"
    doc.write_text(
        f"# {kind.title.split(' (')[0]} ablation (reduced)\n\n"
        f"Written by `{cfg.command}`: {kind.what}, "
        + (f"{cfg.layers} draft layer(s), " if cfg.kind == "block" else "")
        + f"each trained for {cfg.budget_s:g} s ({cfg.dtype}, one thread) on the study's feature cache "
        "(see study-data.md; tokens seen per drafter below), "
        f"evaluated on {cfg.limit} sample(s) per benchmark at temperature 1.0. A reduced version of the paper's "
        "figure; see findings.md for how to read it at this budget.\n\n"
        f"![{cfg.kind} ablation](figures/{fig.name})\n\n" + table, encoding="utf-8")
    return doc, fig


def run_reduced_ablation(cfg: ReducedAblation, docs: Path = Path("docs/reports"),
                         run: Callable[[list[str]], Any] = lambda cmd: subprocess.run(cmd, check=True),
                         log: Callable[[str], None] = lambda msg: print(msg, flush=True)) -> tuple[Path, Path]:
    """Train every drafter of the ablation (resumable), evaluate them together, write the page and the figure."""
    if cfg.kind not in KINDS:
        raise DSparkError(f"unknown ablation {cfg.kind!r}; choose from {', '.join(sorted(KINDS))}")
    for s in KINDS[cfg.kind].series(cfg.layers):
        check_same_settings(cfg.out / "train" / s.name, cfg)
    for cmd in ablation_commands(cfg):
        log("+ " + " ".join(cmd))
        run(cmd)
    return write_ablation_doc(cfg, docs)
