"""`dspark reproduce`: the whole offline study as one resumable chain of `dspark` commands.

    prompts -> regenerate -> tokenize -> train x4 (Eagle3, DFlash, DSpark Markov, DSpark RNN)
    -> calibrate (STS, DSpark) -> eval (Table 1, Fig. 2) -> threshold sweep (Fig. 5)
    [-> ablations: depth 1-5 (Fig. 3), block sizes (Fig. 4)] -> docs/reports/results-study.md

Every step is an ordinary `dspark ...` command (printed by ``--dry-run``), run
in a subprocess. A step that finished leaves a marker in ``OUT/.done/`` and is
skipped on the next run; an interrupted step is rerun, and the commands resume
on their own (regenerate and eval skip finished samples, train continues from
``step_latest``, calibrate keeps its shards). All commands are parsed before
the first one runs, so a flag error cannot stop the chain halfway.

Equal budgets: all drafters of a comparison train on the same tokenized data,
for the same number of epochs, under the same wall-clock cap
(``time_budget_s``). The budget table (``BUDGETS``) fixes every size.
Block-size ablation: the paper's "draft length" 4, 8, 12, 16 counts the anchor,
so the drafters are trained with block_size (gamma) 3, 7, 11, 15.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from dspark.errors import DSparkError
from dspark.studies.ablations import LATEST, ablation_rows, block_series, depth_series


@dataclass(frozen=True)
class Budget:
    name: str
    num_prompts: int  # training prompts (dspark data prompts --num)
    alpaca_num: int  # size of the Alpaca substitute eval set (0 = none)
    regen_max_new_tokens: int  # response length when the target regenerates answers
    regen_batch_size: int
    max_length: int  # tokenized sequence length (tokenize --max-length, train max_length)
    train_epochs: int
    train_time_s: float  # time_budget_s of every main drafter
    eval_limit: int | None  # samples per benchmark (None = DeepSpec caps)
    eval_max_new_tokens: int
    calib_limit: int | None  # held-out prompts per set (None = all rows beyond the caps)
    sweep_thresholds: tuple[float, ...]
    ablation_train_time_s: float  # time_budget_s of every ablation drafter
    block_ablation_layers: int  # draft layers in the block-size ablation (paper: 5)
    train_overrides: tuple[str, ...] = ()  # extra --set for every training run
    # cache the target features of the first N sequences once and train every drafter on them (None = online)
    feature_cache_limit: int | None = None
    calib_max_new_tokens: int | None = None  # None = eval_max_new_tokens

    def table(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "name"}


BUDGETS: dict[str, Budget] = {
    # minutes on a laptop CPU: checks the chain, numbers are noise
    "tiny": Budget("tiny", num_prompts=48, alpaca_num=8, regen_max_new_tokens=64, regen_batch_size=8,
                   max_length=256, train_epochs=1, train_time_s=90, eval_limit=2, eval_max_new_tokens=48,
                   calib_limit=4, sweep_thresholds=(0.0, 0.3, 0.6, 0.9), ablation_train_time_s=45,
                   block_ablation_layers=1),
    # hours on a 2-core CPU with SmolLM2-135M
    "small": Budget("small", num_prompts=600, alpaca_num=40, regen_max_new_tokens=192, regen_batch_size=8,
                    max_length=512, train_epochs=3, train_time_s=1800, eval_limit=10, eval_max_new_tokens=192,
                    calib_limit=30, sweep_thresholds=(0.0, 0.2, 0.4, 0.6, 0.8, 0.9), ablation_train_time_s=600,
                    block_ablation_layers=1),
    # the study committed in docs/reports/results-study.md: about 1.5 hours on a quiet 2-core CPU, given tokenized data
    "cpu": Budget("cpu", num_prompts=1200, alpaca_num=40, regen_max_new_tokens=256, regen_batch_size=24,
                  max_length=512, train_epochs=10, train_time_s=540, eval_limit=2, eval_max_new_tokens=128,
                  calib_limit=6, sweep_thresholds=(0.0, 0.3, 0.6, 0.9), ablation_train_time_s=240,
                  block_ablation_layers=1, feature_cache_limit=640, calib_max_new_tokens=192),
    # a GPU machine; evaluation protocol as DeepSpec (caps, 2048 new tokens)
    "full": Budget("full", num_prompts=50_000, alpaca_num=500, regen_max_new_tokens=2048, regen_batch_size=32,
                   max_length=4096, train_epochs=10, train_time_s=6 * 3600, eval_limit=None,
                   eval_max_new_tokens=2048, calib_limit=None,
                   sweep_thresholds=tuple(round(0.1 * i, 1) for i in range(10)), ablation_train_time_s=3 * 3600,
                   block_ablation_layers=5, train_overrides=("device=auto", "dtype=bfloat16")),
}
DEFAULT_BUDGET = "tiny"

# (name, training preset, --drafter of dspark train)
MAIN_DRAFTERS: tuple[tuple[str, str, str], ...] = (
    ("eagle3", "smollm2-eagle3", "eagle3"),
    ("dflash", "smollm2-dflash", "dflash"),
    ("dspark-markov", "smollm2-dspark-markov", "dspark"),
    ("dspark-rnn", "smollm2-dspark-rnn", "dspark"),
)
CONFIDENCE_DRAFTERS = ("dspark-markov", "dspark-rnn")  # have a confidence head: calibrated
SWEEP_DRAFTER = "dspark-markov"


@dataclass
class Step:
    name: str  # unique; names the marker OUT/.done/<name>
    stage: str  # data | train | calibrate | eval | ablation
    argv: list[str]  # arguments of `dspark`
    outputs: list[str] = field(default_factory=list)  # what the step leaves behind (for the record)

    @property
    def command(self) -> str:
        return "dspark " + shlex.join(self.argv)


# --------------------------------------------------------------------------- plan


def _limit_args(flag: str, value: int | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _train_step(name: str, stage: str, preset: str, kind: str, out: Path, data: Path, target: str,
                budget: Budget, time_s: float, overrides: Sequence[str] = ()) -> Step:
    sets = [f"data={data}", f"target={target}", f"epochs={budget.train_epochs}", f"time_budget_s={time_s:g}",
            f"max_length={budget.max_length}", *budget.train_overrides, *overrides]
    argv = ["train", "--config", preset, "--drafter", kind, "--out", str(out), "--resume"]
    for s in sets:
        argv += ["--set", s]
    return Step(f"train-{name}" if stage == "train" else f"{stage}-train-{name}", stage, argv, [str(out / LATEST)])


def plan(budget: Budget, out: str | Path, target: str, ablations: bool = False,
         data_dir: str | Path | None = None) -> list[Step]:
    """Every command of the study, in order. ``data_dir``: an existing tokenized dataset (skips the data steps)."""
    out = Path(out)
    data = out / "data"
    prompts, regenerated, tok = data / "prompts.jsonl", data / "regenerated.jsonl", data / "tok"
    alpaca = data / "alpaca-substitute.jsonl"
    steps: list[Step] = []
    if data_dir is not None:
        tok = Path(data_dir)
        steps.append(Step("alpaca-substitute", "data", [
            "data", "prompts", "--out", str(data / "unused-prompts.jsonl"), "--num", "3", "--seed", "0",
            "--allow-short", "--alpaca-substitute", str(alpaca), "--alpaca-num", str(budget.alpaca_num),
        ], [str(alpaca)]))
        return _plan_after_data(steps, budget, out, target, ablations, tok, alpaca)

    argv = ["data", "prompts", "--out", str(prompts), "--num", str(budget.num_prompts), "--seed", "0",
            "--allow-short"]
    if budget.alpaca_num:
        argv += ["--alpaca-substitute", str(alpaca), "--alpaca-num", str(budget.alpaca_num)]
    steps.append(Step("prompts", "data", argv, [str(prompts)] + ([str(alpaca)] if budget.alpaca_num else [])))
    steps.append(Step("regenerate", "data", [
        "data", "regenerate", "--target", target, "--prompts", str(prompts), "--out", str(regenerated),
        "--max-new-tokens", str(budget.regen_max_new_tokens), "--batch-size", str(budget.regen_batch_size),
    ], [str(regenerated)]))
    steps.append(Step("tokenize", "data", [
        "data", "tokenize", "--in", str(regenerated), "--target", target, "--out", str(tok),
        "--max-length", str(budget.max_length),
    ], [str(tok)]))
    return _plan_after_data(steps, budget, out, target, ablations, tok, alpaca)


def _plan_after_data(steps: list[Step], budget: Budget, out: Path, target: str, ablations: bool, tok: Path,
                     alpaca: Path) -> list[Step]:
    if budget.feature_cache_limit is not None:
        cache = out / "data" / "features"
        steps.append(Step("features", "data", [
            "data", "features", "--target", target, "--data", str(tok), "--out", str(cache),
            "--max-length", str(budget.max_length), "--limit", str(budget.feature_cache_limit),
        ], [str(cache)]))
        budget = replace(budget, train_overrides=(*budget.train_overrides, "feature_source=cache",
                                                  f"cache_dir={cache}"))
    ckpt = {name: out / "train" / name / LATEST for name, _, _ in MAIN_DRAFTERS}
    for name, preset, kind in MAIN_DRAFTERS:
        steps.append(_train_step(name, "train", preset, kind, out / "train" / name, tok, target, budget,
                                 budget.train_time_s))

    common_eval = ["--target", target, *_limit_args("--limit", budget.eval_limit),
                   "--max-new-tokens", str(budget.eval_max_new_tokens)]
    for name in CONFIDENCE_DRAFTERS:
        cal = out / "calibrate" / name
        steps.append(Step(f"calibrate-{name}", "calibrate", [
            "calibrate", "--target", target, "--drafter", str(ckpt[name]), "--name", name,
            *_limit_args("--limit", budget.calib_limit),
            "--max-new-tokens", str(budget.calib_max_new_tokens or budget.eval_max_new_tokens),
            "--out", str(cal),
        ], [str(cal / "sts.json"), str(cal / "calibration.json"), str(cal / "reliability.png")]))

    jsonl = ["--jsonl", f"alpaca-substitute={alpaca}"] if budget.alpaca_num else []
    argv = ["eval", *common_eval, "--datasets", "all", *jsonl, "--out", str(out / "eval")]
    for name, _, _ in MAIN_DRAFTERS:
        argv += ["--drafter", f"{name}={ckpt[name]}"]
    for name in CONFIDENCE_DRAFTERS:
        argv += ["--sts", f"{name}={out / 'calibrate' / name / 'sts.json'}"]
    steps.append(Step("eval", "eval", argv, [str(out / "eval" / "results.json")]))

    steps.append(Step("sweep", "eval", [
        "eval", *common_eval, "--datasets", "all", *jsonl, "--drafter", f"{SWEEP_DRAFTER}={ckpt[SWEEP_DRAFTER]}",
        "--sweep-thresholds", ",".join(f"{t:g}" for t in budget.sweep_thresholds), "--out", str(out),
    ], [str(out / "sweep" / SWEEP_DRAFTER / "sweep.json")]))  # eval --sweep-thresholds writes OUT/sweep/<name>

    if ablations:
        for label, series in (("depth", depth_series()), ("block", block_series(budget.block_ablation_layers))):
            root = out / "ablations" / label
            for s in series:
                steps.append(_train_step(s.name, f"ablation-{label}", s.preset, s.kind, root / "train" / s.name,
                                         tok, target, budget, budget.ablation_train_time_s, s.overrides))
            argv = ["eval", *common_eval, "--datasets", "all", "--out", str(root / "eval")]
            for s in series:
                argv += ["--drafter", f"{s.name}={root / 'train' / s.name / LATEST}"]
            steps.append(Step(f"ablation-{label}-eval", f"ablation-{label}", argv,
                              [str(root / "eval" / "results.json")]))
    return steps


# --------------------------------------------------------------------------- running


def plan_parser() -> argparse.ArgumentParser:
    """A `dspark` parser of the commands a plan runs (data, train, eval, calibrate), registered as `dspark` does."""
    from dspark.data import cli as data_cli
    from dspark.evaluation import cli as evaluation_cli
    from dspark.training import cli as training_cli

    parser = argparse.ArgumentParser(prog="dspark")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (data_cli, training_cli, evaluation_cli):
        module.add_cli(sub)
    return parser


def check_commands(steps: Sequence[Step]) -> list[str]:
    """Parse every step with the real `dspark` parser; returns one message per step that does not parse."""
    parser = plan_parser()
    problems = []
    for step in steps:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                args = parser.parse_args(step.argv)
            if not getattr(args, "func", None):
                problems.append(f"{step.name}: `{step.command}` names no runnable command")
            elif args.command == "train":
                _check_train_config(args)
        except DSparkError as err:
            problems.append(f"{step.name}: `{step.command}`: {err}")
        except SystemExit:
            msg = err.getvalue().strip().splitlines()
            problems.append(f"{step.name}: `{step.command}` does not parse: {msg[-1] if msg else 'error'}")
    return problems


def _check_train_config(args: argparse.Namespace) -> None:
    """Resolve a `dspark train` config (preset + --set) without training: unknown keys are errors."""
    from dspark.training.config import load_config

    load_config(args.config, args.overrides, drafter=args.drafter, out=args.out)


def subprocess_runner(argv: Sequence[str]) -> int:
    return subprocess.call([sys.executable, "-m", "dspark.cli", *argv])


def run_plan(
    steps: Sequence[Step], out: str | Path, runner: Callable[[Sequence[str]], int] = subprocess_runner,
    dry_run: bool = False, log: Callable[[str], None] = print,
) -> list[str]:
    """Run the steps not yet marked done (or list them with ``dry_run``); returns the names run/listed."""
    markers = Path(out) / ".done"
    problems = check_commands(steps)
    if dry_run:
        for step in steps:
            state = "done" if (markers / step.name).is_file() else "todo"
            log(f"[{state}] {step.command}")
        for p in problems:
            log(f"WARNING: {p}")
        return [s.name for s in steps if not (markers / s.name).is_file()]
    if problems:
        raise DSparkError("some reproduce steps do not parse, nothing was run:\n  " + "\n  ".join(problems))
    markers.mkdir(parents=True, exist_ok=True)
    ran = []
    for i, step in enumerate(steps, 1):
        if (markers / step.name).is_file():
            log(f"[{i}/{len(steps)}] {step.name}: done, skipped")
            continue
        log(f"[{i}/{len(steps)}] {step.name}: {step.command}")
        t0 = time.perf_counter()
        rc = runner(step.argv)
        if rc != 0:
            raise DSparkError(f"step {step.name} failed (exit {rc}): {step.command}\nfix it and rerun `dspark "
                              "reproduce` with the same arguments; finished steps are skipped")
        (markers / step.name).write_text(json.dumps({"command": step.command,
                                                     "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
        ran.append(step.name)
    return ran


# --------------------------------------------------------------------------- docs


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def write_docs(out: str | Path, budget: Budget, docs_path: str | Path, command: str) -> Path:
    """docs/reports/results-study.md (+ docs/reports/figures/) from whatever the run has produced so far."""
    from dspark.evaluation.report import docs_results_markdown, plot_ablation

    out, docs_path = Path(out), Path(docs_path)
    fig_dir = docs_path.parent / "figures"
    figures: dict[str, str] = {}

    def add_figure(caption: str, src: Path, dest_name: str) -> None:
        if src.is_file():
            fig_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, fig_dir / dest_name)
            figures[caption] = f"figures/{dest_name}"

    main = _read_json(out / "eval" / "results.json")
    if main:
        for dom in main["domains"]:
            add_figure(f"Per-position conditional acceptance, {dom} (Fig. 2)", out / "eval" / f"acceptance_{dom}.png",
                       f"acceptance_{dom}.png")
    calibration = {}
    for name in CONFIDENCE_DRAFTERS:
        report = _read_json(out / "calibrate" / name / "calibration.json")
        if report:
            calibration[name] = report
            add_figure(f"Reliability before/after STS, {name} (Fig. 6)", out / "calibrate" / name / "reliability.png",
                       f"reliability_{name}.png")
    sweep = _read_json(out / "sweep" / SWEEP_DRAFTER / "sweep.json")
    sweep_rows = sweep["rows"] if sweep else []
    if sweep:
        add_figure(f"Static threshold sweep, {SWEEP_DRAFTER} (Fig. 5)",
                   out / "sweep" / SWEEP_DRAFTER / "sweep.png", "threshold_sweep.png")
    ablations = {}
    specs = (("depth", "Drafter depth at block size 7 (Fig. 3)", "layers", depth_series()),
             ("block", f"Draft length gamma + 1 at {budget.block_ablation_layers} draft layer(s) (Fig. 4)",
              "draft length", block_series(budget.block_ablation_layers)))
    for label, title, x_name, series in specs:
        rows = ablation_rows(_read_json(out / "ablations" / label / "eval" / "results.json"), series)
        if rows:
            ablations[title] = (x_name, rows)
            fig_dir.mkdir(parents=True, exist_ok=True)
            plot_ablation(rows, fig_dir / f"ablation_{label}.png", x_name, title)
            figures[title] = f"figures/ablation_{label}.png"
    notes = [
        "All drafters of a comparison train on the same regenerated data, for the same epochs, under the same "
        "wall-clock cap (time_budget_s).",
        "Alpaca is not available offline; 'Alpaca (subst.)' is an instruction-following substitute built from "
        "package data reserved away from training (`dspark data prompts --alpaca-substitute`).",
        "STS is fitted on benchmark rows beyond the evaluation caps (disjoint from the evaluated samples); "
        "confidence metrics on the evaluation sets use those temperatures ('sts' rows).",
    ]
    text = docs_results_markdown(command, {"budget": budget.name, **budget.table()}, main, calibration, sweep_rows,
                                 ablations, figures, notes)
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs_path.write_text(text, encoding="utf-8")
    return docs_path


# --------------------------------------------------------------------------- the whole study


def run_study(budget: Budget, out: str | Path, target: str = "smollm2-135m", ablations: bool = False,
              data_dir: str | Path | None = None, docs_path: str | Path = "docs/reports/results-study.md",
              dry_run: bool = False, log: Callable[[str], None] = print) -> Path | None:
    """Plan, run (resumably) and write ``docs_path``; with ``dry_run`` list the commands only (returns None)."""
    steps = plan(budget, out, target, ablations, data_dir)
    command = f"dspark reproduce --budget {budget.name} --out {out}"
    if data_dir:
        command += f" --data {data_dir}"
    if target != "smollm2-135m":
        command += f" --target {target}"
    if ablations:
        command += " --ablations"
    if dry_run:
        run_plan(steps, out, dry_run=True, log=log)
        log(f"then: write {docs_path} from {out}")
        return None
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "plan.json").write_text(json.dumps(
        {"command": command, "budget": asdict(budget), "steps": [asdict(s) for s in steps]}, indent=2) + "\n")
    run_plan(steps, out, log=log)
    return write_docs(out, budget, docs_path, command)
