"""The host work of one verify step, timed: the step's verification (``_verify``: greedy requests by argmax, the
others by target probabilities and rejection sampling) against every row through distributions (``_target_probs``
and ``rejection_sample``, the path before greedy requests skipped them), for R requests with K drafts each over
SmolLM2's vocabulary.

    PYTHONPATH=src python scripts/host_work.py                          # settings mixed, 8 requests, 7 drafts
    PYTHONPATH=src python scripts/host_work.py --greedy --requests 32 --drafts 0   # plain greedy decoding at 32

The requests mix settings as a server's do (greedy; temperature 1; temperature 0.7 with top-k 50; temperature
1 with top-p 0.9), each with its own seeded generator (``--greedy``: all greedy); one thread. Prints the median
milliseconds of 30 steps after 3 warm-up steps for both paths, measured alternately in one run, and whether they
commit the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.generation.step import _target_probs, _verify
from dspark.sampling.processing import SamplingParams
from dspark.sampling.rejection import rejection_sample


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--drafts", type=int, default=7)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--greedy", action="store_true", help="every request greedy (temperature 0)")
    args = p.parse_args()
    torch.set_num_threads(1)
    R, K, V = args.requests, args.drafts, args.vocab
    kinds = [SamplingParams(0.0)] if args.greedy else [
        SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=50), SamplingParams(1.0, top_p=0.9)]
    data = torch.Generator().manual_seed(0)
    logits = (torch.randn(R * (K + 1), V, generator=data) * 4).to(torch.bfloat16)  # (R (K+1), V) as the target gives
    draft_probs = torch.softmax(torch.randn(R, K, V, generator=data) * 4, -1)  # (R, K, V)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=data).reshape(R, K)  # (R, K)
    block = DraftBlock(draft_tokens, torch.full((R,), K), draft_probs)

    def requests(step: int) -> list[RequestState]:
        return [RequestState(str(r), 1, [1], kinds[r % len(kinds)], torch.Generator().manual_seed(100 * step + r))
                for r in range(R)]

    def distributions(reqs):  # every row through distributions
        target_probs = _target_probs(logits, reqs, [K + 1] * R, K)  # (R, K+1, V)
        out = rejection_sample(draft_tokens, torch.full((R,), K), draft_probs, target_probs, [r.generator for r in reqs])
        return [row[: a + 1] for row, a in zip(out.output_tokens.tolist(), out.num_accepted.tolist())]

    def step(reqs):
        return _verify(logits, reqs, [K + 1] * R, draft_tokens if K else None, block, V)[1]

    times = {"distributions": [], "step": []}
    same = True
    for i in range(3 + args.steps):
        got = {}
        for name, fn in (("distributions", distributions), ("step", step)):
            reqs = requests(i)
            t0 = time.perf_counter()
            got[name] = fn(reqs)
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
        same &= got["distributions"] == got["step"]
    before, now = (1000 * statistics.median(times[k]) for k in ("distributions", "step"))
    print(f"R={R} K={K} V={V}{' greedy' if args.greedy else ' mixed settings'}: every row through distributions "
          f"{before:.1f} ms, the step's verification {now:.1f} ms ({before / now:.1f}x less; median of {args.steps}), "
          f"same tokens: {same}")


if __name__ == "__main__":
    main()
