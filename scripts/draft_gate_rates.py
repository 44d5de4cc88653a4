"""What the asynchronous scheduler's draft gate measures, prompt by prompt (docs/serving/step-cost.md §Skipping the
drafter): one request at a time through ``SpeculativeGenerator`` with ``--policy async`` (the whole-step profile at
start, as ``dspark serve`` makes it), printing after each prompt its acceptance length, how many steps skipped the
drafter so far and the gate's measured rates (steps, tokens per step, ms per step, tokens/s) of drafting and plain
steps at one request.

    PYTHONPATH=src python scripts/draft_gate_rates.py                        # GSM8K, HumanEval, MT-Bench, 2 each
    PYTHONPATH=src python scripts/draft_gate_rates.py --sets mt-bench,gsm8k --per-set 3 --threads 2

The reference drafter with its STS, SmolLM2-135M in bf16. Timings: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="checkpoints/smollm2-135m-dspark")
    p.add_argument("--sets", default="gsm8k,humaneval,mt-bench", help="comma list of evaluation sets, in this order")
    p.add_argument("--per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    from dspark.data.eval_sets import BENCHMARKS
    from dspark.errors import DSparkError

    unknown = [name for name in args.sets.split(",") if name not in BENCHMARKS]
    if unknown:  # before the target loads
        p.error(f"unknown set(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    try:
        run(args)
    except DSparkError as e:  # a bad --drafter folder, a checkpoint of another target: one line, no traceback
        raise SystemExit(f"draft_gate_rates.py: {e}")


def load_reference(drafter_path: str, threads: int):
    """SmolLM2-135M in bf16 on ``threads`` threads, the drafter at ``drafter_path`` and its STS temperatures (None
    without an ``sts.json``): (target, drafter, sts). ``scripts/policy_rates.py`` loads the same way."""
    import torch

    from dspark.cli_options import drafting_options
    from dspark.drafters.registry import load_drafter
    from dspark.target.loading import load_decoding_target

    torch.set_num_threads(threads)
    target = load_decoding_target("smollm2-135m", "cpu", "bfloat16", False, True)
    drafter = load_drafter(drafter_path, target, drafting_options(argparse.Namespace(), hybrid=False))
    sts_path = Path(drafter_path) / "sts.json"
    sts = json.loads(sts_path.read_text())["temperatures"] if sts_path.is_file() else None
    return target, drafter, sts


def run(args: argparse.Namespace) -> None:
    import torch

    from dspark.data.eval_sets import load_eval_dataset
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.generation.step_profile import load_or_profile_cost
    from dspark.sampling.processing import SamplingParams
    from dspark.scheduler.adapter import make_policy

    target, drafter, sts = load_reference(args.drafter, args.threads)
    adapter = make_policy("async", load_or_profile_cost(None, target, drafter, 1), sts)
    gate = adapter.policy
    gen = SpeculativeGenerator(target, drafter, policy=adapter)
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    print("| prompt | tau | steps skipped so far | drafting: steps, tokens/step, ms/step, tok/s | "
          "plain: steps, tokens/step, ms/step, tok/s |")
    print("|---|---:|---:|---|---|")
    for name in args.sets.split(","):
        for i, sample in enumerate(load_eval_dataset(name, limit=args.per_set).samples):
            with torch.inference_mode():
                res = gen.generate([target.encode_chat(sample.prompt)], sp)[0]
            cells = ["-" if m is None else f"{m[0]}, {m[1]:.2f}, {m[2] * 1000:.1f}, {m[1] / m[2]:.1f}"
                     for m in gate.measured(1)]
            print(f"| {name} #{i} | {res.stats.acceptance_length:.2f} | {gate.skipped_steps} | {cells[0]} | "
                  f"{cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
