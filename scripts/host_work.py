"""The host work of one verify step, timed: target probabilities for every verify row (``_target_probs``) and
rejection sampling (``rejection_sample``), for R requests with K drafts each over SmolLM2's vocabulary.

    PYTHONPATH=src python scripts/host_work.py                 # this checkout
    PYTHONPATH=/tmp/old/src python scripts/host_work.py        # another commit's (git archive COMMIT src | tar -x -C /tmp/old)

The requests mix settings as a server's do (greedy; temperature 1; temperature 0.7 with top-k 50; temperature
1 with top-p 0.9), each with its own seeded generator; one thread. Prints the median milliseconds of 30 steps
after 3 warm-up steps, and a checksum of the sampled tokens (equal across versions that draw the same stream).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.drafters.base import RequestState
from dspark.generation.step import _target_probs
from dspark.sampling.processing import SamplingParams
from dspark.sampling.rejection import rejection_sample


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--drafts", type=int, default=7)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    R, K, V = args.requests, args.drafts, args.vocab
    kinds = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=50), SamplingParams(1.0, top_p=0.9)]
    data = torch.Generator().manual_seed(0)
    logits = torch.randn(R * (K + 1), V, generator=data) * 4  # (R (K+1), V)
    draft_probs = torch.softmax(torch.randn(R, K, V, generator=data) * 4, -1)  # (R, K, V)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=data).reshape(R, K)  # (R, K)
    times, checksum = [], 0
    for step in range(3 + args.steps):
        requests = [RequestState(str(r), 1, [1], kinds[r % len(kinds)], torch.Generator().manual_seed(100 * step + r))
                    for r in range(R)]
        t0 = time.perf_counter()
        target_probs = _target_probs(logits, requests, [K + 1] * R, K)  # (R, K+1, V)
        out = rejection_sample(draft_tokens, torch.full((R,), K), draft_probs, target_probs,
                               [r.generator for r in requests])
        if step >= 3:
            times.append(time.perf_counter() - t0)
            checksum += int(out.output_tokens.clamp_min(0).sum())
    print(f"R={R} K={K} V={V}: host work per step {1000 * statistics.median(times):.1f} ms (median of "
          f"{args.steps}), token checksum {checksum}")


if __name__ == "__main__":
    main()
