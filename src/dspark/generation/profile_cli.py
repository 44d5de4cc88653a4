"""`dspark profile`: measure the target's SPS table (SGLang's ``dspark_sps.json``) and, with ``--step-cost``,
the whole engine step's cost model (``dspark.scheduler.step_cost``)."""

from __future__ import annotations

import argparse

from dspark.target.presets import DEFAULT_TARGET
from dspark.cli_options import add_target_options, drafting_options, load_target_from_args


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", aliases=["profile-sps"],
        help="profile target steps/s against batch tokens (the SPS table of the hardware-aware scheduler)",
        description="Times target.forward over flattened batches of B tokens against warm KV caches of "
        "--context-len tokens: every B up to block size + 1 (one request), then R x (block size + 1) for R = 2, 3, "
        "4, 6, 8, 12, ... and --max-requests, and writes the SGLang-format SPS JSON (sample_batch_tokens, "
        "sample_steps_per_sec, max_batch_tokens) with every B up to the largest, the step time linear between the "
        "timed ones. With --step-cost FILE it also times real engine steps of R = 1..--max-requests requests with "
        "--drafter (default none) verifying every draft, and writes the whole-step cost model (verify ms by batch "
        "tokens, drafting ms by drafting requests, host ms by requests with sampled and with greedy requests; "
        "docs/serving/step-cost.md), which --sps-table of `dspark serve` and `dspark bench serve` accept and "
        "alg1/async plan on. "
        "Example: dspark profile --target smollm2-135m --drafter prompt-lookup --block-size 7 --max-requests 16 "
        "--context-len 256 --out sps.json --step-cost step_cost.json",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    add_target_options(p)
    p.add_argument("--block-size", type=int, default=7, help="draft tokens per step gamma (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=16, help="largest batch in requests (default: %(default)s)")
    p.add_argument("--context-len", type=int, default=256,
                   help="tokens already in each request's KV cache (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per grid point (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes per grid point (default: %(default)s)")
    p.add_argument("--dense", action="store_true",
                   help="time every batch-token count up to --max-requests x (block size + 1), not only the "
                   "grid above (a longer profile)")
    p.add_argument("--prefill", action="store_true",
                   help="time prefill passes instead (the table `dspark simulate --prefill-sps-table` reads): one "
                   "request's chunk of B tokens (the same grid) after --context-len cached ones (0 allowed), "
                   "last-token logits only, as the serving engine prefills; e.g. --prefill --block-size 63 "
                   "--max-requests 8 --context-len 0 times chunks of 64..512 tokens")
    p.add_argument("--drafter", default=None,
                   help="optional drafter whose target_layer_ids the verify pass captures (costs a little); with "
                   "--step-cost, the drafter whose drafting is timed (none | prompt-lookup | a checkpoint)")
    p.add_argument("--step-cost", default=None, metavar="FILE",
                   help="also profile drafting and per-step host work in real engine steps and write the whole-step "
                   "cost model to FILE (not with --prefill)")
    p.add_argument("--threads", type=int, default=argparse.SUPPRESS,  # not None: `dspark --threads N profile` keeps N
                   help="torch CPU threads (default: torch's choice); profile with the setting you will serve with")
    p.add_argument("--out", default="sps.json", help="output JSON (default: %(default)s)")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from dspark.errors import DSparkError
    from dspark.scheduler.profile import profile_target

    if args.step_cost and args.prefill:
        raise DSparkError("--step-cost times decode steps; profile prefill passes (--prefill) in another run")
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    target = load_target_from_args(args, tokenizer=False)
    drafter = None
    if args.drafter:
        from dspark.drafters.registry import load_drafter

        drafter = load_drafter(args.drafter, target, drafting_options(args))
    capture = drafter.target_layer_ids if drafter is not None else None
    table = profile_target(target, args.block_size, args.max_requests, args.context_len, args.repeats,
                           args.warmup, capture, args.dense, prefill=args.prefill)
    table.save(args.out)
    print(f"wrote {args.out}")
    for b, sps in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
        print(f"  {b:>6} batch tokens: {sps:8.2f} steps/s  ({b * sps:9.1f} tokens/s)")
    if args.step_cost:
        from dspark.generation.step_profile import profile_step_cost

        model = profile_step_cost(target, drafter, args.block_size, args.max_requests, args.context_len,
                                  args.repeats, args.warmup, args.dense, verify=table,
                                  profile={"drafter": args.drafter or "none", "target": args.target})
        model.save(args.step_cost)
        print(f"wrote {args.step_cost}")
        for r in model.draft.grid:
            greedy = f" ({model.host_greedy.at(r):6.2f} greedy)" if model.host_greedy is not None else ""
            print(f"  {r:>3} requests: drafting {model.draft.at(r):8.2f} ms, host {model.host.at(r):7.2f} ms{greedy}, "
                  f"verify of {r * (args.block_size + 1)} tokens {model.verify.at(r * (args.block_size + 1)):8.2f} ms")
    return 0
