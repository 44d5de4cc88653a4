"""`dspark generate`: one prompt in, text and speculative statistics out."""

from __future__ import annotations

import argparse
import json
import time

from dspark.cli_options import add_drafter_options, add_target_options, drafting_options, load_target_from_args
from dspark.target.presets import DEFAULT_TARGET


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1.0 = off")
    p.add_argument("--seed", type=int, default=0, help="random seed of the request (default: %(default)s)")


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text with speculative decoding and print acceptance statistics",
        description="Runs one prompt through the target with a drafter. Greedy output (temperature 0) equals "
        "the target's own greedy output token for token; sampled output follows the target's distribution.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    add_target_options(p)
    p.add_argument("--drafter", default="prompt-lookup",
                   help="none | prompt-lookup | a DSpark/DFlash/Eagle3 checkpoint folder | an HF causal-LM folder "
                   "(independent draft model) (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    add_drafter_options(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--chat", help="a user message, rendered with the target's chat template")
    g.add_argument("--prompt", help="raw text prompt, no chat template")
    add_sampling_args(p)
    p.add_argument("--compare-plain", action="store_true",
                   help="also decode without speculation and report the speedup (and, when greedy, whether the texts match)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_generate)


def _run(target, drafter, prompt_ids, sampling):
    from dspark.generation.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(target, drafter)
    t0 = time.perf_counter()
    res = gen.generate([prompt_ids], sampling)[0]
    return res, time.perf_counter() - t0


def _generate(args: argparse.Namespace) -> int:
    from dspark.drafters.base import NoDrafter
    from dspark.drafters.registry import load_drafter
    from dspark.sampling.processing import SamplingParams

    target = load_target_from_args(args)
    drafter = load_drafter(args.drafter, target, drafting_options(args))
    prompt_ids = target.encode_chat(args.chat) if args.chat is not None else target.encode_text(args.prompt)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed)
    target.check_prompt(prompt_ids, args.max_new_tokens)
    res, secs = _run(target, drafter, prompt_ids, sampling)
    text = target.tokenizer.decode(res.output_ids, skip_special_tokens=True)
    s = res.stats
    report = {
        "text": text, "drafter": args.drafter, "new_tokens": len(res.output_ids), "finish_reason": res.finish_reason,
        "seconds": round(secs, 3), "tokens_per_s": round(len(res.output_ids) / secs, 2),
        "acceptance_length": round(s.acceptance_length, 3), "verify_rate": round(s.verify_rate, 3),
        "steps": s.num_steps, "per_position_acceptance": [round(a, 3) for a in s.per_position_acceptance()],
    }
    if args.compare_plain:
        plain, psecs = _run(target, NoDrafter(target.vocab_size), prompt_ids, sampling)
        report["plain_tokens_per_s"] = round(len(plain.output_ids) / psecs, 2)
        report["speedup"] = round(report["tokens_per_s"] / report["plain_tokens_per_s"], 3)
        if sampling.greedy:
            report["matches_plain_greedy"] = plain.output_ids == res.output_ids
    if args.json:
        print(json.dumps(report))
        return 0
    print(text)
    print("-" * 60)
    for k, v in report.items():
        if k != "text":
            print(f"{k:>24}: {v}")
    return 0
