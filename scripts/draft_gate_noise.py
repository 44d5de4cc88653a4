"""How close the async draft gate gets to the faster kind of step when drafting steps are noisy
(``dspark.simulate.gate_noise``): for each request count and true gain of drafting over plain steps, the mean over
seeds of the rate the gate reached over the better kind's, with the gate as it is (``SETTLE_Z`` = 2) and with
verdicts from the window's point estimate alone (``SETTLE_Z`` = 0, the rule before); at a fixed request count and
with the count moving as a served level's does (``--churn``). Synthetic steps, no model: it runs in under a minute
and its numbers do not depend on the machine.

    PYTHONPATH=src python scripts/draft_gate_noise.py --out docs/serving/draft-gate-noise.md
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,2,4,8,16", help="comma list of request counts")
    p.add_argument("--gains", default="0.7,0.9,1.05,1.12,1.25", help="comma list of drafting's true gain")
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--churn", default="0,0.15",
                   help="comma list of the share of steps in which the request count moves by one (0 = fixed)")
    p.add_argument("--out", type=Path, help="write the table here as Markdown (default: print it)")
    args = p.parse_args()
    requests = [int(r) for r in args.requests.split(",")]
    gains = [float(g) for g in args.gains.split(",")]
    churns = [float(c) for c in args.churn.split(",")]

    from dspark.scheduler.policies import AsyncTopKScheduler
    from dspark.simulate import gate_noise

    rules = {"point estimate alone (SETTLE_Z = 0)": 0.0, f"as shipped (SETTLE_Z = {AsyncTopKScheduler.SETTLE_Z:g})":
             AsyncTopKScheduler.SETTLE_Z}
    shipped = AsyncTopKScheduler.SETTLE_Z
    lines = [
        "# The draft gate on noisy steps (synthetic)",
        "",
        f"Written by `PYTHONPATH=src python scripts/draft_gate_noise.py --requests {args.requests} --gains "
        f"{args.gains} --seeds {args.seeds} --churn {args.churn}{' --out ' + str(args.out) if args.out else ''}`.",
        "",
        f"A plain step commits R tokens in {gate_noise.PLAIN_S * 1000:g} ms; a drafting step commits per request 1 +"
        f" the accepted prefix of {gate_noise.DRAFTS} drafts (each accepted with probability {gate_noise.ACCEPTANCE:g}"
        " after the one before) in the time that makes drafting `gain` times a plain step's rate. Each cell: the rate"
        " the gate reached after its first 100 of 600 steps over the better kind's rate, mean over"
        f" {args.seeds} seeds (1.00 = always the faster kind). docs/serving/step-cost.md §Skipping the drafter.",
        "",
        "**churn**: the share of steps in which the request count moves by one request, within the top quarter of its"
        " range and at least one below the top (at R requests: "
        + ", ".join(f"{r}: {lo}-{hi}" for r in requests for lo, hi in [gate_noise.churn_range(r)])
        + "), as clients come and go in a served level; the gate keeps its rates per request count, and each cell"
        " compares with the better kind at each step's count. 0: the count stays at R.",
        "",
        "| rule | requests | churn | " + " | ".join(f"gain {g:g}" for g in gains) + " | worst |",
        "|---|---:|---:|" + "---:|" * (len(gains) + 1),
    ]
    try:
        for name, z in rules.items():
            AsyncTopKScheduler.SETTLE_Z = z
            for churn in churns:
                for r in requests:
                    cells = [sum(gate_noise.gate_efficiency(gate_noise.synthetic_gate, g, r, seed, churn=churn)
                                 for seed in range(args.seeds)) / args.seeds for g in gains]
                    lines.append(f"| {name} | {r} | {churn:g} | " + " | ".join(f"{c:.3f}" for c in cells)
                                 + f" | {min(cells):.3f} |")
    finally:
        AsyncTopKScheduler.SETTLE_Z = shipped
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
