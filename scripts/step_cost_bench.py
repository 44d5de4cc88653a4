"""alg1 / async planning on the whole-step cost model against planning on the target-only SPS table, with
fixed:1 as the baseline, through the HTTP server in one run (docs/serving/step-cost.md §Measured).

Loads the target and drafter once, then for every round serves each policy in turn (the order rotates per
round, so a drift of the machine's load falls on every policy alike) with the same closed-loop clients as
`dspark bench serve` (``dspark.bench.serve_load.run_point``). Ratios are against fixed:1 of the same round.

    .venv/bin/python scripts/step_cost_bench.py --drafter checkpoints/smollm2-135m-dspark \\
        --sts checkpoints/smollm2-135m-dspark/sts.json --sps-table runs/step-cost/sps.json \\
        --step-cost runs/step-cost/step_cost.json --concurrency 8 --num-requests 8 --max-tokens 32 --rounds 2 \\
        --threads 1 --out docs/serving/step-cost-bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter", required=True)
    p.add_argument("--sts", default=None)
    p.add_argument("--sps-table", required=True, help="the target-only SPS table (`dspark profile --out`)")
    p.add_argument("--step-cost", required=True, help="the whole-step model (`dspark profile --step-cost`)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/serving/step-cost-bench", help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)

    import torch

    from dspark.bench.serve_load import closed_loop, load_prompts, run_point
    from dspark.drafters.options import DraftingOptions
    from dspark.drafters.registry import load_drafter
    from dspark.scheduler.adapter import make_policy
    from dspark.scheduler.step_cost import StepCostModel
    from dspark.scheduler.sts import load_sts_json
    from dspark.serving.engine import Engine, EngineConfig
    from dspark.serving.server import ServerConfig, ServerThread, create_app
    from dspark.target.loading import torch_dtype
    from dspark.target.model import load_target

    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=torch_dtype(args.dtype), fuse=True, batch_invariant=True, pack=True)
    drafter = load_drafter(args.drafter, target, DraftingOptions())
    temps = load_sts_json(args.sts, drafter.block_size) if args.sts else None
    tables = {"sps": StepCostModel.load(args.sps_table), "step": StepCostModel.load(args.step_cost)}
    if not tables["sps"].verify_only or tables["step"].verify_only:
        raise SystemExit("--sps-table must be a plain SPS table and --step-cost a whole-step model")
    policies = [("fixed:1", "fixed:1", None), ("alg1 on SPS", "alg1", "sps"), ("alg1 on step cost", "alg1", "step"),
                ("async on SPS", "async", "sps"), ("async on step cost", "async", "step")]
    prompts = load_prompts(None, limit=4 * max(args.num_requests, args.concurrency))
    rows = []
    for rnd in range(args.rounds):
        shift = rnd % len(policies)
        for label, name, table in policies[shift:] + policies[:shift]:
            policy = make_policy(name, tables[table] if table else None, temps)
            engine = Engine(target, drafter, policy, EngineConfig(max_batch=args.concurrency,
                                                                  max_queue=args.concurrency))
            app = create_app(engine, target.tokenizer, ServerConfig(model_name=args.target))
            with ServerThread(app) as server:
                asyncio.run(closed_loop(server.url, prompts, 1, 1, 8, args.temperature))  # warm-up, not measured
                row = run_point(server.url, prompts, args.concurrency, args.num_requests, args.max_tokens,
                                args.temperature, label, seed=rnd)
            row["round"] = rnd
            rows.append(row)
            print(f"round {rnd} {label:>20}: {row['total_tokens_per_s']:6.1f} tok/s total, "
                  f"{row['user_tokens_per_s']:5.1f} per user, verify {row['avg_verify_len'] or 0:.2f}, "
                  f"errors {row['errors']}", flush=True)
    summary = _summary(rows, [label for label, _, _ in policies], args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python scripts/step_cost_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, "load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cost_tables": {k: v.to_dict() for k, v in tables.items()}}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1) + "\n")
    lines = [f"Reproduce: `{command}`", "",
             f"Concurrency {args.concurrency}, {args.num_requests} requests of {args.max_tokens} tokens per point, "
             f"temperature {args.temperature}, {args.rounds} rounds; load average at the end "
             f"{meta['load_average'][0]:.1f} on {os.cpu_count()} CPUs. Ratios are medians over rounds of the ratio "
             "to fixed:1 in the same round.", "",
             "| policy | total tok/s | per-user tok/s | total / fixed:1 | per-user / fixed:1 | verify len | errors |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['policy']} | {s['total']:.1f} | {s['user']:.1f} | {s['total_ratio']:.2f} | "
                     f"{s['user_ratio']:.2f} | {s['verify_len']:.2f} | {s['errors']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _summary(rows: list[dict], labels: list[str], rounds: int) -> list[dict]:
    base = {r["round"]: r for r in rows if r["policy"] == "fixed:1"}
    summary = []
    for label in labels:
        mine = [r for r in rows if r["policy"] == label]
        summary.append({
            "policy": label,
            "total": statistics.median(r["total_tokens_per_s"] for r in mine),
            "user": statistics.median(r["user_tokens_per_s"] for r in mine),
            "total_ratio": statistics.median(r["total_tokens_per_s"] / base[r["round"]]["total_tokens_per_s"]
                                             for r in mine),
            "user_ratio": statistics.median(r["user_tokens_per_s"] / base[r["round"]]["user_tokens_per_s"]
                                            for r in mine),
            "verify_len": statistics.median(r["avg_verify_len"] or 0.0 for r in mine),
            "errors": sum(r["errors"] for r in mine),
        })
    return summary


if __name__ == "__main__":
    sys.exit(main())
