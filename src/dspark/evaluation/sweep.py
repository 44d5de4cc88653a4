"""Static confidence-threshold sweep (paper Fig. 5, §4.4 "diagnostic").

For each threshold t the drafter's block is cut at the first per-step
confidence c_k = sigmoid(logit_k / T_k) below t (``StaticThreshold``, DeepSpec
semantics; T_k = 1 unless STS temperatures are given) and the target verifies
only the kept prefix. Per domain, pooling every step of the domain's
benchmarks, the sweep reports draft tokens verified per step, accepted and
rejected per step, the acceptance rate (accepted / verified) and tau.

Each threshold is an ordinary ``evaluate`` run in ``out_dir/threshold-<t>``
(resumable); ``sweep.json``, ``sweep.md`` and ``sweep.png`` sit in ``out_dir``.
Thresholds are lossless (the cut depends on drafts before position k only),
so the sampled texts keep the target's distribution at every point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from dspark.data.eval_sets import DEFAULT_SEED, EvalDataset
from dspark.errors import DSparkError
from dspark.evaluation.report import clean_json, sweep_markdown
from dspark.evaluation.runner import evaluate
from dspark.generation.stats import AcceptanceStats

SWEEP_DEFINITION = (
    "per domain, pooled over every step of the domain's benchmarks: verified_per_step = draft tokens verified / "
    "steps; accepted_per_step = draft tokens accepted / steps; rejected_per_step = their difference; "
    "acceptance_rate = accepted / verified; acceptance_length = tau (bonus included)"
)


def parse_thresholds(text: str) -> list[float]:
    """``"0,0.1,0.5"`` -> [0.0, 0.1, 0.5]; each in [0, 1]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DSparkError(f"--sweep-thresholds {text!r}: expected comma-separated numbers in [0, 1]") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise DSparkError(f"--sweep-thresholds {text!r}: expected comma-separated numbers in [0, 1]")
    return sorted(set(values))


def sweep_rows(results: Mapping[str, Any], threshold: float, drafter: str) -> list[dict[str, Any]]:
    """One row per domain of ``results`` (an ``evaluate`` results dict) for ``drafter`` at ``threshold``."""
    res = results["drafters"][drafter]
    rows = []
    for domain, names in results["domains"].items():
        pooled: AcceptanceStats | None = None
        for name in names:
            counters = res["benchmarks"][name].get("stats")
            if not counters:
                continue
            stats = AcceptanceStats.from_dict(counters)
            if pooled is None:
                pooled = stats
            else:
                pooled.merge(stats)
        if pooled is None or pooled.num_steps == 0:
            continue
        steps, verified, accepted = pooled.num_steps, pooled.num_proposed, pooled.num_accepted
        rows.append({
            "drafter": drafter,
            "threshold": threshold,
            "domain": domain,
            "num_steps": steps,
            "verified_per_step": verified / steps,
            "accepted_per_step": accepted / steps,
            "rejected_per_step": (verified - accepted) / steps,
            "acceptance_rate": accepted / verified if verified else None,
            "acceptance_length": pooled.acceptance_length,
        })
    return rows


def sweep_thresholds(
    target,
    drafter,
    datasets: Sequence[EvalDataset],
    thresholds: Sequence[float],
    out_dir: str | Path,
    *,
    name: str = "dspark",
    temperatures: Sequence[float] | None = None,  # (K,) STS temperatures applied before the threshold
    temperature: float = 1.0,
    max_new_tokens: int = 2048,
    seed: int = DEFAULT_SEED,
    batch_size: int = 1,
    drafter_spec: str | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run ``evaluate`` once per threshold and write sweep.json / sweep.md / sweep.png."""
    from dspark.evaluation.plots import plot_threshold_sweep
    from dspark.scheduler.policies import StaticThreshold

    out = Path(out_dir)
    rows: list[dict[str, Any]] = []
    for threshold in sorted(thresholds):
        results = evaluate(
            target, {name: drafter}, datasets, temperature, max_new_tokens, seed, out / f"threshold-{threshold:g}",
            StaticThreshold(threshold), batch_size=batch_size,
            temperatures={name: list(temperatures)} if temperatures is not None else None,
            drafter_specs={name: drafter_spec} if drafter_spec else None, progress=progress,
        )
        benches = results["drafters"][name]["benchmarks"].values()
        if not any(b.get("has_confidence") for b in benches):
            raise DSparkError(f"drafter {name!r} produced no confidence logits; the threshold sweep needs a drafter "
                              "with a confidence head (a DSpark checkpoint)")
        rows += sweep_rows(results, threshold, name)
    figure = plot_threshold_sweep(rows, out / "sweep.png", title=f"Static confidence threshold: {name}")
    payload = clean_json({"definition": SWEEP_DEFINITION, "drafter": name, "thresholds": sorted(thresholds),
                      "temperatures": list(temperatures) if temperatures is not None else None, "rows": rows})
    (out / "sweep.json").write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    (out / "sweep.md").write_text(sweep_markdown(rows, SWEEP_DEFINITION, figure), encoding="utf-8")
    return rows
