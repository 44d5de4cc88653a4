"""`dspark profile`: measure the target's SPS table and write SGLang's ``dspark_sps.json``."""

from __future__ import annotations

import argparse

from dspark.target.presets import DEFAULT_TARGET
from dspark.cli_options import add_target_options, drafting_options, load_target_from_args


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", aliases=["profile-sps"],
        help="profile target steps/s against batch tokens (the SPS table of the hardware-aware scheduler)",
        description="Times target.forward over flattened batches of R requests x (block size + 1) tokens "
        "against warm KV caches of --context-len tokens, R = 1..--max-requests, and writes the SGLang-format "
        "SPS JSON (sample_batch_tokens, sample_steps_per_sec, max_batch_tokens). "
        "Example: dspark profile --target smollm2-135m --block-size 7 --max-requests 16 --context-len 256 "
        "--out sps.json",
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
                   help="time every batch-token count, not only multiples of block size + 1")
    p.add_argument("--prefill", action="store_true",
                   help="time prefill passes instead (the table `dspark simulate --prefill-sps-table` reads): one "
                   "request's chunk of B = R x (block size + 1) tokens after --context-len cached ones (0 allowed), "
                   "last-token logits only, as the serving engine prefills; e.g. --prefill --block-size 63 "
                   "--max-requests 8 --context-len 0 times chunks of 64..512 tokens")
    p.add_argument("--drafter", default=None,
                   help="optional drafter whose target_layer_ids the verify pass captures (costs a little)")
    p.add_argument("--threads", type=int, default=argparse.SUPPRESS,  # not None: `dspark --threads N profile` keeps N
                   help="torch CPU threads (default: torch's choice); profile with the setting you will serve with")
    p.add_argument("--out", default="sps.json", help="output JSON (default: %(default)s)")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from dspark.scheduler.profile import profile_target

    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    target = load_target_from_args(args, tokenizer=False)
    capture = None
    if args.drafter:
        from dspark.drafters.registry import load_drafter

        capture = load_drafter(args.drafter, target, drafting_options(args)).target_layer_ids
    table = profile_target(target, args.block_size, args.max_requests, args.context_len, args.repeats,
                           args.warmup, capture, args.dense, prefill=args.prefill)
    table.save(args.out)
    print(f"wrote {args.out}")
    for b, sps in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
        print(f"  {b:>6} batch tokens: {sps:8.2f} steps/s  ({b * sps:9.1f} tokens/s)")
    return 0
