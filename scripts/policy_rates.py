"""Tokens per second of plain decoding, fixed:1, verify-all and async on static batches of R mixed prompts, in one
process (docs/serving/step-cost.md §Drafting some requests): what drafting costs at a batch size, without the
server. Prompts cycle through GSM8K, MT-Bench, Arena-Hard and HumanEval, so each batch mixes requests whose
acceptance differs 2-3x. For async it prints the draft gate's measured steps at R (drafting and plain: steps,
tokens per step, ms per step) and what one more drafting request adds (ms, by request count).

    PYTHONPATH=src python scripts/policy_rates.py                      # 4 requests, 2 batches, 2 rounds
    PYTHONPATH=src python scripts/policy_rates.py --requests 1 --batches 4
    PYTHONPATH=src python scripts/policy_rates.py --requests 16 --policies fixed:1,fixed:2,fixed:3,all,async

The reference drafter with its STS, SmolLM2-135M in bf16, one thread. Timings: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import time

SETS = ("gsm8k", "mt-bench", "arena-hard-v2", "humaneval")
POLICIES = ("plain", "fixed:1", "all", "async")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="checkpoints/smollm2-135m-dspark")
    p.add_argument("--requests", type=int, default=4, help="requests per batch (R)")
    p.add_argument("--batches", type=int, default=2, help="batches per policy and round")
    p.add_argument("--rounds", type=int, default=2, help="times the whole comparison runs (the first warms up)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma list: plain, all, async, alg1 or fixed:K (default: %(default)s)")
    args = p.parse_args()
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not args.policies:
        p.error("--policies names no policy")
    from dspark.scheduler.adapter import PolicyError, parse_policy

    for name in args.policies:  # a misspelt policy fails here, not after the model has loaded
        if name != "plain":
            try:
                parse_policy(name)
            except PolicyError as e:
                p.error(str(e))
    if min(args.requests, args.batches, args.rounds, args.max_new_tokens, args.threads) < 1:
        p.error("--requests, --batches, --rounds, --max-new-tokens and --threads must be >= 1")

    from dspark.errors import DSparkError

    try:
        run(args)
    except DSparkError as e:  # a bad --drafter folder: one line, no traceback
        raise SystemExit(f"policy_rates.py: {e}")


def run(args: argparse.Namespace) -> None:
    import torch
    from draft_gate_rates import load_reference  # the sibling script (this folder is on sys.path when run)

    from dspark.data.eval_sets import load_eval_dataset
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.generation.step_profile import load_or_profile_cost
    from dspark.sampling.processing import SamplingParams
    from dspark.scheduler.adapter import make_policy

    target, drafter, sts = load_reference(args.drafter, args.threads)
    total = args.requests * args.batches
    per_set = -(-total // len(SETS))
    samples = {name: load_eval_dataset(name, limit=per_set).samples for name in SETS}
    prompts = [target.encode_chat(samples[SETS[i % len(SETS)]][i // len(SETS)].prompt) for i in range(total)]
    batches = [prompts[b * args.requests:(b + 1) * args.requests] for b in range(args.batches)]
    cost = load_or_profile_cost(None, target, drafter, args.requests)
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    print(f"| round | policy | R | tokens/s per batch | tau per request | gate at R: drafting, plain "
          f"(steps, tokens/step, ms/step) | one more drafting request (ms, by R) |")
    print("|---:|---|---:|---|---|---|---|")
    for rnd in range(1, args.rounds + 1):
        for name in args.policies:
            gate = None
            if name == "plain":
                gen = SpeculativeGenerator(target, None)
            elif name == "all":
                gen = SpeculativeGenerator(target, drafter)
            else:
                adapter = make_policy(name, cost, sts)
                gate = adapter.policy if name == "async" else None
                gen = SpeculativeGenerator(target, drafter, policy=adapter)
            rates, taus = [], []
            for batch in batches:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    results = gen.generate(batch, sp)
                rates.append(sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0))
                taus += [r.stats.acceptance_length for r in results]
            gate_cells = ["-", "-"]
            if gate is not None:
                measured = ["-" if m is None else f"{m[0]}, {m[1]:.2f}, {m[2] * 1000:.1f}"
                            for m in gate.measured(args.requests)]
                gate_cells = ["; ".join(measured),
                              ", ".join(f"{r}: {v[1] * 1000:.1f}" for r, v in gate.measured_marginal().items()) or "-"]
            print(f"| {rnd} | {name} | {args.requests} | {', '.join(f'{r:.1f}' for r in rates)} | "
                  f"{', '.join(f'{t:.2f}' for t in taus)} | {gate_cells[0]} | {gate_cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
