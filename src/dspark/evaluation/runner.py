"""Offline acceptance evaluation: drafters x benchmarks -> tau tables, curves, confidence metrics.

The protocol follows DeepSpec's evaluator (docs/interop.md §Evaluation protocol): temperature 1.0,
one request per batch (``batch_size`` > 1 runs small static batches instead),
sample ``idx`` decoded with seed ``seed + idx``, every proposed draft verified
unless a verify policy (e.g. a static confidence threshold) is given; it reads
the drafter's confidences through ``dspark.scheduler.confidence.ConfidenceAdapter``
(with the drafter's STS temperatures), as generate and serve do.

Files in ``out_dir``:

* ``run.json`` — the settings; a rerun with other settings into the same folder is refused.
* ``samples.jsonl`` — one record per (drafter, benchmark, sample), appended as
  samples finish: ``drafter``, ``dataset``, ``idx``, ``row``, ``seed``,
  ``prompt_tokens``, ``new_tokens``, ``finish_reason``, ``seconds``, ``stats``
  (``AcceptanceStats.to_dict()``) and, without a policy, ``confidence``
  (per step the raw confidence logits of the proposed drafts and the number
  accepted). A rerun skips the samples already recorded (resume).
* ``results.json``, ``results.md`` (paper Table 1 layout) and
  ``acceptance_<domain>.png`` (paper Fig. 2), rebuilt from the records.

Averages (also written into ``results.json`` under ``definitions``):
benchmark tau pools every step of every sample (sum of tau / number of steps);
a domain's value is the unweighted mean over its benchmarks (macro); overall is
the unweighted mean over domains, so each domain weighs the same whatever its
number of benchmarks.

Shapes: R = requests in a step, K = block size (gamma).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from dspark.data.eval_sets import DEFAULT_SEED, DOMAINS, EvalDataset, EvalSample
from dspark.drafters.base import Drafter
from dspark.errors import DSparkError
from dspark.evaluation.calibration import position_bins
from dspark.evaluation.intervals import paired_difference, tau_intervals
from dspark.evaluation.metrics import confidence_report
from dspark.evaluation.report import clean_json, write_results
from dspark.generation.stats import AcceptanceStats
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import VerifyPolicy
from dspark.scheduler.sts import save_sts_json

DEFINITIONS = {
    "acceptance_length": "tau: tokens committed per verification cycle, bonus token included; per benchmark "
    "it pools all steps of all samples (sum of tau / number of steps)",
    "verify_rate": "committed tokens per verified position: sum tau / (sum draft tokens verified + steps)",
    "per_position_acceptance": "conditional acceptance at draft position k: P(draft k accepted | drafts < k "
    "accepted, draft k verified) (paper §4.3.1)",
    "prefix_acceptance": "DeepSpec accept_rate@k: #(steps accepting > k drafts) / #(steps verifying > k drafts)",
    "domain": "macro average: unweighted mean over the domain's evaluated benchmarks (curves: position-wise "
    "mean over benchmarks that reached the position)",
    "overall": "unweighted mean over the evaluated domains of the domain macro averages (each domain weighs the "
    "same); benchmark_mean is the unweighted mean over all evaluated benchmarks",
    "acceptance_length_ci": "95 % interval of tau from 2,000 bootstrap replicates that redraw each benchmark's "
    "prompts with replacement (domains and overall: the same macro means of each replicate)",
    "comparisons": "tau(drafter) - tau(baseline) on the prompts both evaluated, with a paired bootstrap 95 % "
    "interval (both drafters resampled with the same prompt draws); 'better' when the overall interval is above 0",
    "confidence": "survival_k = prod_{j<=k} sigmoid(logit_j / T_j) against label 'drafts 0..k accepted', "
    "ECE over 20 equal-width bins, AUROC, Brier; 'raw' uses T = 1, 'sts' the given STS temperatures",
}


# --------------------------------------------------------------------------- records


@dataclass
class EvalSettings:
    temperature: float = 1.0
    max_new_tokens: int = 2048
    seed: int = DEFAULT_SEED
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 1
    policy: str | None = None
    target: str | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def record_key(record: Mapping[str, Any]) -> tuple[str, str, int, int]:
    return (str(record["drafter"]), str(record["dataset"]), int(record["idx"]), int(record["row"]))


def read_records(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Records of ``samples.jsonl``; a torn last line (killed run) is dropped (and cut from the file if ``repair``)."""
    if not path.is_file():
        return []
    records = []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")  # JSON strings may hold U+2028 and kin, which splitlines() would cut at
    if lines and lines[-1] == "":
        lines.pop()  # the newline after the last record
    torn = False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise DSparkError(f"{path}:{i + 1} is corrupt; delete the line or the file to rerun those samples")
            torn = True  # interrupted while writing; the sample is run again
    if repair and (torn or (text and not text.endswith("\n"))):
        kept = lines[:-1] if torn else lines
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return records


def _append_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")
        f.flush()


def _check_run_file(out_dir: Path, settings: EvalSettings, drafter_specs: Mapping[str, str]) -> None:
    """Write ``run.json``, or check that an existing one describes the same run."""
    path = out_dir / "run.json"
    current = {"settings": asdict(settings), "drafters": dict(drafter_specs)}
    if path.is_file():
        previous = json.loads(path.read_text(encoding="utf-8"))
        if previous.get("settings") != current["settings"]:
            raise DSparkError(
                f"{out_dir} holds a run with other settings ({previous.get('settings')}); "
                "use a new --out folder or delete this one"
            )
        clash = {n: (previous["drafters"][n], s) for n, s in drafter_specs.items()
                 if n in previous.get("drafters", {}) and previous["drafters"][n] != s}
        if clash:
            raise DSparkError(f"{out_dir}: drafter names already used for other drafters {clash}; rename them")
        current["drafters"] = {**previous.get("drafters", {}), **current["drafters"]}
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- running


def _encode(target, sample: EvalSample) -> list[int]:
    if isinstance(sample.prompt, str):
        if target.tokenizer is None:
            raise DSparkError(f"{sample.dataset}: text prompts need a target with a tokenizer")
        return target.encode_chat(sample.prompt)
    return list(sample.prompt)


def _confidence_payload(records: list[tuple[torch.Tensor, int]]) -> dict[str, list]:
    """Ragged per-step logits (rounded to 1e-4) and accepted counts, JSON-ready."""
    return {
        "logits": [[round(float(x), 4) for x in conf.tolist()] for conf, _ in records],
        "num_accepted": [int(acc) for _, acc in records],
    }


def run_samples(
    target, drafter: Drafter, name: str, dataset: EvalDataset, settings: EvalSettings,
    records_path: Path | None, done: set[tuple[str, str, int, int]], policy: ConfidenceAdapter | None = None,
    progress: bool = True, keep_confidence: bool = True,
) -> list[dict[str, Any]]:
    """Decode the samples of ``dataset`` not in ``done``; append and return their records."""
    from tqdm.auto import tqdm

    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    pending = [s for s in dataset.samples if (name, dataset.name, s.idx, s.row) not in done]
    generator = SpeculativeGenerator(target, drafter, policy=policy)
    out: list[dict[str, Any]] = []
    bar = tqdm(total=len(dataset.samples), initial=len(dataset.samples) - len(pending),
               desc=f"{name} / {dataset.name}", unit="sample", disable=not progress, leave=False)
    for start in range(0, len(pending), settings.batch_size):
        batch = pending[start : start + settings.batch_size]
        prompts = [_encode(target, s) for s in batch]
        sampling = [SamplingParams(settings.temperature, settings.top_k, settings.top_p, settings.max_new_tokens,
                                   seed=s.seed) for s in batch]
        t0 = time.perf_counter()
        results = generator.generate(prompts, sampling, [str(s.idx) for s in batch], collect_confidences=True)
        seconds = (time.perf_counter() - t0) / len(batch)
        for sample, prompt, res in zip(batch, prompts, results):
            record = {
                "drafter": name, "dataset": dataset.name, "idx": sample.idx, "row": sample.row,
                "seed": sample.seed, "prompt_tokens": len(prompt), "new_tokens": len(res.output_ids),
                "finish_reason": res.finish_reason, "seconds": round(seconds, 4),
                "stats": res.stats.to_dict(), "has_confidence": bool(res.confidence_records),
            }
            if keep_confidence and policy is None and res.confidence_records:
                record["confidence"] = _confidence_payload(res.confidence_records)
            if records_path is not None:
                _append_record(records_path, record)
            out.append(record)
        bar.update(len(batch))
    bar.close()
    return out


def evaluate(
    target,
    drafters: Mapping[str, Drafter],
    datasets: Sequence[EvalDataset],
    temperature: float = 1.0,
    max_new_tokens: int = 2048,
    seed: int = DEFAULT_SEED,
    out_dir: str | Path | None = None,
    policy: VerifyPolicy | None = None,  # StaticThreshold, ...; None = verify all
    *,
    batch_size: int = 1,
    top_k: int = 0,
    top_p: float = 1.0,
    temperatures: Mapping[str, Sequence[float]] | None = None,  # drafter name -> STS temperatures
    drafter_specs: Mapping[str, str] | None = None,  # drafter name -> what was loaded, for run.json
    progress: bool = True,
    write_outputs: bool = True,
) -> dict[str, Any]:
    """Evaluate every drafter on every dataset; returns (and writes) the results dict.

    ``seed`` only labels the run here: per-sample seeds come from the datasets
    (built with the same seed). Samples already in ``out_dir/samples.jsonl`` are skipped.
    """
    if not drafters:
        raise DSparkError("give at least one drafter")
    if not datasets:
        raise DSparkError("give at least one dataset")
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise DSparkError(f"dataset names must be unique, got {names}")
    off = [(d.name, s.idx) for d in datasets for s in d.samples if s.seed != seed + s.idx]
    if off:
        raise DSparkError(f"samples {off[:3]} were not built with seed {seed} (seed + idx); load the datasets "
                          "with the same seed")
    temperatures = dict(temperatures or {})
    settings = EvalSettings(temperature, max_new_tokens, seed, top_k, top_p, batch_size,
                            None if policy is None else repr(policy), getattr(target, "name", None))
    specs = {n: (drafter_specs or {}).get(n, type(d).__name__) for n, d in drafters.items()}
    out = Path(out_dir) if out_dir is not None else None
    records_path = None
    records: list[dict[str, Any]] = []
    if out is not None:
        _check_run_file(out, settings, specs)
        records_path = out / "samples.jsonl"
        records = read_records(records_path, repair=True)
    done = {record_key(r) for r in records}
    for name, drafter in drafters.items():
        # the same adapter as generate and serve: STS temperatures, fallback 1.0 without a confidence head
        step_policy = None if policy is None else ConfidenceAdapter(policy, temperatures.get(name))
        for dataset in datasets:
            records += run_samples(target, drafter, name, dataset, settings, records_path, done,
                                   step_policy, progress)
    results = aggregate(records, list(drafters), datasets, settings, specs, temperatures)
    if out is not None and write_outputs:
        write_results(results, out)
    return results


# --------------------------------------------------------------------------- aggregation


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else None


def _mean_curve(curves: Sequence[Sequence[float | None]]) -> list[float | None]:
    width = max((len(c) for c in curves), default=0)
    return [_mean([c[k] for c in curves if k < len(c)]) for k in range(width)]


def confidence_arrays(records: Sequence[Mapping[str, Any]], block_size: int):
    """Stack the ``confidence`` payloads: logits (N, K), proposed_mask (N, K), num_accepted (N,)."""
    rows, accepted = [], []
    for r in records:
        payload = r.get("confidence")
        if payload:
            rows += payload["logits"]
            accepted += payload["num_accepted"]
    n = len(rows)
    logits = torch.zeros(n, block_size)  # (N, K)
    mask = torch.zeros(n, block_size, dtype=torch.bool)  # (N, K)
    for i, row in enumerate(rows):
        logits[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return logits, mask, torch.tensor(accepted, dtype=torch.long)


def benchmark_summary(
    records: Sequence[Mapping[str, Any]], temperatures: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Pooled statistics of one drafter on one benchmark."""
    stats: AcceptanceStats | None = None
    for r in records:
        s = AcceptanceStats.from_dict(r["stats"])
        if stats is None:
            stats = s
        else:
            stats.merge(s)
    if stats is None:
        return {"num_samples": 0}
    summary = stats.to_dict()
    counters = {k: summary.pop(k) for k in ("block_size", "counts", "sum_acceptance_length")}
    summary = {
        "num_samples": len(records),
        "new_tokens": sum(int(r["new_tokens"]) for r in records),
        "seconds": round(sum(float(r["seconds"]) for r in records), 3),
        **summary,
        "num_proposed": stats.num_proposed,
        "num_accepted": stats.num_accepted,
        "stats": counters,
        "has_confidence": any(bool(r.get("has_confidence")) for r in records),
        "confidence": None,
    }
    if any(r.get("confidence") for r in records):
        logits, mask, accepted = confidence_arrays(records, stats.block_size)
        summary["confidence"] = {"raw": confidence_report(logits, mask, accepted)}
        if temperatures is not None:
            summary["confidence"]["sts"] = confidence_report(logits, mask, accepted, temperatures)
            summary["confidence"]["temperatures"] = list(temperatures)
        summary["confidence"]["position_bins"] = position_bins(logits, mask, accepted, temperatures)
    return summary


def aggregate(
    records: Sequence[Mapping[str, Any]],
    drafter_names: Sequence[str],
    datasets: Sequence[EvalDataset],
    settings: EvalSettings,
    specs: Mapping[str, str] | None = None,
    temperatures: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The results dict from per-sample records (only those of the current selection count)."""
    temperatures = temperatures or {}
    wanted = {(d.name, s.idx, s.row) for d in datasets for s in d.samples}
    by_key: dict[tuple[str, str], list] = {}
    records_in = [r for r in records if (r["dataset"], int(r["idx"]), int(r["row"])) in wanted
                  and r["drafter"] in drafter_names]
    for r in records_in:
        by_key.setdefault((r["drafter"], r["dataset"]), []).append(r)
    domain_order = list(DOMAINS) + sorted({d.domain for d in datasets} - set(DOMAINS))
    domains = {dom: [d.name for d in datasets if d.domain == dom] for dom in domain_order}
    domains = {dom: names for dom, names in domains.items() if names}
    drafters: dict[str, Any] = {}
    for name in drafter_names:
        bench = {d.name: benchmark_summary(by_key.get((name, d.name), []), temperatures.get(name))
                 for d in datasets}
        dom_summary = {}
        for dom, names in domains.items():
            rows = [bench[n] for n in names if bench[n].get("num_samples")]
            dom_summary[dom] = {
                "benchmarks": names,
                "acceptance_length": _mean([r["acceptance_length"] for r in rows]),
                "verify_rate": _mean([r["verify_rate"] for r in rows]),
                "mean_proposal_len": _mean([r["mean_proposal_len"] for r in rows]),
                "per_position_acceptance": _mean_curve([r["per_position_acceptance"] for r in rows]),
                "prefix_acceptance": _mean_curve([r["prefix_acceptance"] for r in rows]),
            }
        filled = [b for b in bench.values() if b.get("num_samples")]
        drafters[name] = {
            "spec": (specs or {}).get(name),
            "benchmarks": bench,
            "domains": dom_summary,
            "overall": {
                "acceptance_length": _mean([d["acceptance_length"] for d in dom_summary.values()]),
                "verify_rate": _mean([d["verify_rate"] for d in dom_summary.values()]),
                "benchmark_mean": _mean([b["acceptance_length"] for b in filled]),
            },
        }
    results = {"domains": domains, "drafters": drafters}
    intervals = tau_intervals(records_in, results)
    for name, ci in intervals.items():
        res = drafters[name]
        res["overall"]["acceptance_length_ci"] = ci["overall"]
        for dom, interval in ci["domains"].items():
            res["domains"][dom]["acceptance_length_ci"] = interval
        for bench_name, interval in ci["benchmarks"].items():
            res["benchmarks"][bench_name]["acceptance_length_ci"] = interval
    names = list(drafter_names)
    comparisons = [paired_difference(records_in, results, b, a) for i, a in enumerate(names) for b in names[i + 1:]]
    return clean_json({
        "definitions": DEFINITIONS,
        "settings": asdict(settings),
        "datasets": [{"name": d.name, "domain": d.domain, "num_samples": len(d), "source": d.source}
                     for d in datasets],
        "domains": domains,
        "drafters": drafters,
        "comparisons": comparisons,
    })


# --------------------------------------------------------------------------- calibration


def _shard_rows(results, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Confidence records of generation results -> logits (N, K), proposed_mask (N, K), num_accepted (N,)."""
    rows = [(conf, acc) for res in results for conf, acc in res.confidence_records]
    logits = torch.zeros(len(rows), block_size)  # (N, K)
    mask = torch.zeros(len(rows), block_size, dtype=torch.bool)  # (N, K)
    for i, (conf, _) in enumerate(rows):
        logits[i, : conf.numel()] = conf.float()
        mask[i, : conf.numel()] = True  # no policy: every proposed draft was verified
    return logits, mask, torch.tensor([acc for _, acc in rows], dtype=torch.long)


def collect_confidence_shards(
    target, drafter: Drafter, datasets: Sequence[EvalDataset], shard_dir: str | Path, *,
    temperature: float = 1.0, max_new_tokens: int = 2048, batch_size: int = 1, progress: bool = True,
) -> list[Path]:
    """Decode every sample with all drafts verified; one confidence shard per batch (resumable).

    Shards are ``<shard_dir>/<dataset>-<first idx>-<last idx>.pt`` in
    ``calibration.save_confidence_shard``'s format (SGLang-readable).
    """
    from tqdm.auto import tqdm

    from dspark.evaluation.calibration import save_confidence_shard
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    shard_dir = Path(shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)
    generator = SpeculativeGenerator(target, drafter)
    block_size = drafter.block_size
    if block_size < 1:
        raise DSparkError("calibration needs a drafter that proposes drafts (block size >= 1)")
    paths: list[Path] = []
    for dataset in datasets:
        batches = [dataset.samples[i : i + batch_size] for i in range(0, len(dataset.samples), batch_size)]
        for batch in tqdm(batches, desc=f"calibrate / {dataset.name}", unit="batch", disable=not progress,
                          leave=False):
            path = shard_dir / f"{dataset.name}-{batch[0].idx:06d}-{batch[-1].idx:06d}.pt"
            paths.append(path)
            if path.is_file():
                continue
            sampling = [SamplingParams(temperature, 0, 1.0, max_new_tokens, seed=s.seed) for s in batch]
            results = generator.generate([_encode(target, s) for s in batch], sampling,
                                         [str(s.idx) for s in batch], collect_confidences=True)
            if any(r.stats.num_proposed and not r.confidence_records for r in results):
                raise DSparkError("the drafter produced no confidence logits; STS calibration needs a drafter "
                                  "with a confidence head (a DSpark checkpoint)")
            tmp = path.with_name(path.name + ".tmp")
            save_confidence_shard(tmp, *_shard_rows(results, block_size))
            tmp.replace(path)
    return paths


def calibrate(
    target, drafter: Drafter, datasets: Sequence[EvalDataset], out_dir: str | Path, *,
    temperature: float = 1.0, max_new_tokens: int = 2048, batch_size: int = 1, n_bins: int = 20,
    grid: Sequence[float] | None = None, drafter_name: str | None = None, heldout: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """Collect confidences on held-out prompts, fit STS, write sts.json, calibration.{json,md}, reliability.png."""
    from dspark.evaluation.calibration import fit_sts, load_confidence_shards
    from dspark.evaluation.metrics import survival_by_position
    from dspark.evaluation.plots import plot_reliability
    from dspark.evaluation.report import calibration_markdown

    out = Path(out_dir)
    shards = collect_confidence_shards(target, drafter, datasets, out / "shards", temperature=temperature,
                                       max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress)
    data = load_confidence_shards(shards)
    if data.logits.shape[0] == 0:
        raise DSparkError("no speculative steps were recorded; use more prompts or more --max-new-tokens")
    names = [d.name for d in datasets]
    try:
        sts = fit_sts(data.logits, data.proposed_mask, data.num_accepted, grid=grid, n_bins=n_bins)
    except ValueError as err:  # e.g. a draft position never verified: too few prompts or new tokens
        raise DSparkError(f"STS fit failed: {err}") from None
    sts_path = out / "sts.json"
    save_sts_json(sts_path, sts, dataset=",".join(names))
    before = confidence_report(data.logits, data.proposed_mask, data.num_accepted, n_bins=n_bins)
    after = confidence_report(data.logits, data.proposed_mask, data.num_accepted, sts.temperatures, n_bins=n_bins)
    pairs_raw = survival_by_position(data.logits, data.proposed_mask, data.num_accepted)
    pairs_sts = survival_by_position(data.logits, data.proposed_mask, data.num_accepted, sts.temperatures)
    figure = plot_reliability(
        [label for _, label in pairs_raw],
        {"before STS": [pred for pred, _ in pairs_raw], "after STS": [pred for pred, _ in pairs_sts]},
        out / "reliability.png", n_bins=n_bins, title=f"Confidence reliability: {drafter_name or 'drafter'}",
    )
    report = clean_json({
        "drafter": drafter_name, "target": getattr(target, "name", None), "datasets": names,
        "heldout": heldout or "given prompts", "num_prompts": sum(len(d) for d in datasets),
        "num_steps": int(data.logits.shape[0]), "n_bins": n_bins, "temperature": temperature,
        "max_new_tokens": max_new_tokens, "temperatures": sts.temperatures, "sts_path": str(sts_path),
        "before": before, "after": after,
        "position_bins": position_bins(data.logits, data.proposed_mask, data.num_accepted, sts.temperatures),
    })
    (out / "calibration.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (out / "calibration.md").write_text(calibration_markdown(report, figure), encoding="utf-8")
    return report
