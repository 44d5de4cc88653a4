"""The inputs of docs/serving/simulated.md: the paper's acceptance curves and the roofline SPS table.

Writes docs/serving/simulated/inputs.md (curve fits, roofline assumptions, SPS samples),
acceptance_<domain>.png (the fitted Fig. 2 curves), paper_drafters.json (DSpark's simulator statistics) and
sps_dense_8b_h200.json.
    .venv/bin/python scripts/simulated_inputs.py
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.evaluation.plots import plot_acceptance_curves
from dspark.simulate.paper import fit_curves, paper_drafters
from dspark.simulate.roofline import dense_8b_h200

OUT = Path("docs/serving/simulated")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    fits = fit_curves("Qwen3-8B")
    lines = ["# Inputs of the simulated paper setting", "",
             "Written by `.venv/bin/python scripts/simulated_inputs.py` (src/dspark/simulate/paper.py, roofline.py).", "",
             "## Acceptance: paper Table 1 (Qwen3-8B) and the Fig. 2 values stated in §4.3.1", "",
             "| drafter | domain | Table 1 tau | stated (Qwen3-4B) | fitted | p_1 | slope | p_1..p_7 |",
             "|---|---|---:|---|---|---:|---:|---|"]
    for drafter, domains in fits.items():
        for dom, f in domains.items():
            stated = ", ".join(f"p{k} = {v}" for k, v in f["stated"].items()) or "–"
            lines.append(f"| {drafter} | {dom} | {f['tau']:.2f} | {stated} | {f['fitted']} | {f['p1']:.3f} | "
                         f"{f['slope']:+.4f} | {', '.join(f'{v:.2f}' for v in f['curve'])} |")
    for dom in ("math", "code", "chat"):
        plot_acceptance_curves({d: fits[d][dom]["curve"] for d in fits}, OUT / f"acceptance_{dom}.png",
                               title=f"Fitted per-position acceptance, {dom} (paper Table 1 + Fig. 2 text)")
    paper_drafters()["DSpark"].save(OUT / "paper_drafters.json")
    roof = dense_8b_h200()
    desc = roof.describe()
    roof.table().save(OUT / "sps_dense_8b_h200.json")
    lines += ["", "## Roofline SPS table", "", "| assumption | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in desc.items()]
    lines += ["", "| batch tokens | step ms | steps/s |", "|---:|---:|---:|"]
    for b in (1, 8, 64, 128, 129, 192, 193, 256, 400, 512, 1024, 1400):
        lines.append(f"| {b} | {1e3 * roof.step_seconds(b):.2f} | {1 / roof.step_seconds(b):.1f} |")
    (OUT / "inputs.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(json.dumps(desc, indent=1))


if __name__ == "__main__":
    main()
