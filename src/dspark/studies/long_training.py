"""What a longer training budget does (docs/reports/long-training.md), written by ``bench/long_training.sh``.

The shell script trains DSpark (Markov head) for BUDGET seconds and DFlash for the same number of optimizer
steps on the study's feature cache, evaluates both next to the study's own DSpark drafter, then calls
``write_long_training_page`` with the folders it used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dspark.tables import markdown_table


def _summary(run: str | Path) -> dict:
    return json.loads((Path(run) / "train_summary.json").read_text())


def write_long_training_page(run: str | Path, eval_dir: str | Path, budget: str, study_run: str | Path,
                             dflash_run: str | Path, docs: str | Path = "docs/reports") -> Path:
    """DOCS/long-training.md (+ the math acceptance figure in DOCS/figures; DOCS: docs/reports) from the runs' summaries and the eval folder."""
    docs, eval_dir = Path(docs), Path(eval_dir)
    long, short, dflash = _summary(run), _summary(study_run), _summary(dflash_run)
    (docs / "figures").mkdir(parents=True, exist_ok=True)
    shutil.copy(eval_dir / "acceptance_math.png", docs / "figures" / "long_training_acceptance_math.png")
    rows = []
    for name, s, how in (("dspark-markov", short, "540 s, float32, 2 threads (`dspark reproduce --budget cpu`)"),
                         ("dspark-markov-long", long, f"{budget} s, bfloat16, 1 thread (this script)"),
                         ("dflash-long", dflash, f"{dflash['steps']} steps like dspark-markov-long, bfloat16, 1 thread")):
        m = s["final_metrics"]
        rows.append([name, how, str(s["steps"]), f"{s['tokens_seen']:.0f}", f"{s['tokens_per_s']:.0f}",
                     " ".join(f"{m[k]:.2f}" for k in sorted(m) if k.startswith("acc@")), f"{m['tau']:.3f}"])
    table = markdown_table(["drafter", "training", "steps", "tokens seen", "train tok/s",
                            "train acceptance at draft positions 1..7", "train tau"], rows)
    results = (eval_dir / "results.md").read_text().split("\n", 1)[1]
    page = docs / "long-training.md"
    page.write_text(
        "# A longer training budget\n\n"
        f"Written by `bash bench/long_training.sh {budget}`: the study's DSpark (Markov head) configuration trained "
        f"again on the same feature cache (640 sequences, see study-data.md) for {budget} s in bfloat16 (fp32 master "
        "weights), then the study's DFlash configuration for the same number of optimizer steps (the same sequences; "
        "it ran alongside other jobs, so its seconds are not comparable), both evaluated exactly as results-study.md next "
        "to the study's DSpark drafter. The accuracies and tau of the training table are the trainer's own estimates "
        "on its last training batches: acc@k is the mean soft acceptance sum_v min(p_draft, p_target) at draft "
        "position k with teacher-forced previous tokens, tau = 1 + sum of their running products.\n\n"
        + "\n".join(table) + "\n\n"
        "![per-position acceptance, math](figures/long_training_acceptance_math.png)\n\n" + results)
    return page
