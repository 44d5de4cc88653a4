"""DSpark's drafting step, timed: ``DSparkDrafter.propose`` of the reference drafter for R requests, K drafts each.

    PYTHONPATH=src python scripts/propose_time.py                       # 1, 8 and 32 requests, settings mixed
    PYTHONPATH=/tmp/old/src python scripts/propose_time.py --greedy     # another commit's src (git archive)
    PYTHONPATH=src python scripts/propose_time.py --catch-up 16         # after 16 steps that skipped the drafter
    PYTHONPATH=src python scripts/propose_time.py --plain-layout        # the drafter unfused and unpacked

SmolLM2-135M in bf16 (fused, prepacked) with checkpoints/smollm2-135m-dspark (head over its top 64 tokens, as the
demo runs it; ``--head-top-m 0``: over all W, as `dspark serve` runs it by default), one thread; each request has a 200-token context of the first turn of an evaluation prompt and its
own settings, mixed greedy / temperature 1 / temperature 0.7 with top-k 50 / temperature 1 with top-p 0.9 and a
seeded generator (``--greedy``: all greedy). Prints the median milliseconds of 20 proposals after 3 warm-up ones per
R, a checksum of the proposed tokens (equal checksums: the same drafts) and the sum of the confidence logits. ``--catch-up N``: before each proposal
every request's drafter state forgets its last N context rows, so the proposal first projects them again, as after N
steps that skipped the drafter (the asynchronous scheduler's plain steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,8,32", help="comma list of R (default: %(default)s)")
    p.add_argument("--drafts", type=int, default=7)
    p.add_argument("--greedy", action="store_true", help="every request greedy")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--head-top-m", type=int, default=64, metavar="M",
                   help="the sequential head drafts among the top M tokens of U_k; 0 = all W, `dspark serve`'s "
                   "default (default: %(default)s, the demo's)")
    p.add_argument("--plain-layout", action="store_true",
                   help="load the drafter unpacked and unfused (load_dspark_drafter(pack=False)): the layout the "
                   "trainer's model has, for comparing drafts across commits without the fused layout's rounding")
    p.add_argument("--catch-up", type=int, default=0, metavar="N",
                   help="context rows each request catches up on before each proposal (default: %(default)s)")
    args = p.parse_args()
    if not 0 <= args.catch_up < 200:  # each request's context is 200 tokens
        p.error(f"--catch-up must be 0-199 (rows of a 200-token context), got {args.catch_up}")
    torch.set_num_threads(1)

    from dspark.data.eval_sets import load_eval_dataset
    from dspark.drafters.base import RequestState
    from dspark.drafters.options import DraftingOptions
    from dspark.drafters.registry import load_drafter
    from dspark.sampling.processing import SamplingParams
    from dspark.target.model import load_target

    target = load_target("smollm2-135m", dtype=torch.bfloat16, fuse=True, pack=True)
    if args.plain_layout:
        from dspark.drafters.dspark.drafter import load_dspark_drafter

        drafter = load_dspark_drafter("checkpoints/smollm2-135m-dspark", target, head_top_m=args.head_top_m or None,
                                      pack=False)
    else:
        drafter = load_drafter("checkpoints/smollm2-135m-dspark", target,
                               DraftingOptions(head_top_m=args.head_top_m, dtype="bfloat16"))
    texts = [s.prompt for s in load_eval_dataset("mt-bench", limit=40).samples]
    mixed = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=50),
             dict(temperature=1.0, top_p=0.9)]
    for R in (int(x) for x in args.requests.split(",")):
        reqs = []
        for i in range(R):
            ids = (target.encode_chat(texts[i % len(texts)]) * 8)[:200]
            sp = SamplingParams(**({"temperature": 0.0} if args.greedy else mixed[i % 4]), seed=i, max_new_tokens=64)
            req = RequestState(f"r{i}", len(ids) - 1, list(ids), sp, sp.make_generator())
            out = target.forward(torch.tensor(ids[:-1]), [len(ids) - 1], None,
                                 capture_layers=drafter.target_layer_ids, logits_for="none")
            req.context_features = out.features
            reqs.append(req)
        times, checksum, confidence = [], 0, 0.0
        with torch.inference_mode():
            for i in range(3 + args.repeats):
                if i and args.catch_up:  # the drafter's state forgets the last N rows: the proposal projects them
                    for req in reqs:
                        req.draft_state.truncate(req.draft_state.length - args.catch_up)
                t0 = time.perf_counter()
                block = drafter.propose(reqs, [args.drafts] * R)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1000)
                checksum += int((block.tokens * torch.arange(1, block.tokens.numel() + 1).view_as(block.tokens)).sum())
                if block.confidence_logits is not None:
                    confidence += float(block.confidence_logits.double().sum())
        print(f"R={R:3d} K={args.drafts} catch-up {args.catch_up}: {statistics.median(times):7.2f} ms per propose (median of {args.repeats}), "
              f"tokens checksum {checksum}, confidence sum {confidence:.6f}", flush=True)


if __name__ == "__main__":
    main()
