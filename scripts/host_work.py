"""The host work of one verify step, timed: the step's verification (``_verify``: greedy requests by argmax, the
others by rejection sampling reading the distributions only where it needs them) against every row through whole
distributions (every row's ``logits_to_probs_rows`` into (R, K+1, V), the drafts' into (R, K, V), and
``rejection_sample``: the path before greedy requests skipped them and before the sampler read rows), for R requests
with K drafts each over SmolLM2's vocabulary.

    PYTHONPATH=src python scripts/host_work.py                          # settings mixed, 8 requests, 7 drafts
    PYTHONPATH=src python scripts/host_work.py --greedy --requests 32 --drafts 0   # plain greedy decoding at 32
    PYTHONPATH=src python scripts/host_work.py --temperature 1 --requests 16       # every request at temperature 1

The requests mix settings as a server's do (greedy; temperature 1; temperature 0.7 with top-k 50; temperature
1 with top-p 0.9), each with its own seeded generator (``--greedy``: all greedy; ``--temperature T``: all at T, no
top-k or top-p); one thread. With ``--draft-vocab W`` the drafts come from a draft vocabulary of W tokens, as the
shipped drafter's do. Prints the median milliseconds of 30 steps after 3 warm-up steps for both paths, measured
alternately in one run, and whether they commit the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.generation.step import _verify
from dspark.sampling.processing import SamplingParams, logits_to_probs_rows
from dspark.sampling.rejection import rejection_sample


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--drafts", type=int, default=7)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--greedy", action="store_true", help="every request greedy (temperature 0)")
    p.add_argument("--temperature", type=float, default=None, help="every request at this temperature")
    p.add_argument("--draft-vocab", type=int, default=None, help="drafts from a draft vocabulary of this many tokens")
    args = p.parse_args()
    torch.set_num_threads(1)
    R, K, V = args.requests, args.drafts, args.vocab
    kinds = [SamplingParams(0.0)] if args.greedy else [SamplingParams(args.temperature)] if args.temperature \
        is not None else [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=50),
                          SamplingParams(1.0, top_p=0.9)]
    data = torch.Generator().manual_seed(0)
    logits = (torch.randn(R * (K + 1), V, generator=data) * 4).to(torch.bfloat16)  # (R (K+1), V) as the target gives
    W = args.draft_vocab or V
    vocab = torch.randperm(V, generator=data)[:W].sort().values if args.draft_vocab else None  # (W,)
    draft_probs = torch.softmax(torch.randn(R, K, W, generator=data) * 4, -1)  # (R, K, W)
    entries = torch.multinomial(draft_probs.reshape(-1, W), 1, generator=data).reshape(R, K)  # (R, K)
    draft_tokens = entries if vocab is None else vocab[entries]
    block = DraftBlock(draft_tokens, torch.full((R,), K), draft_probs, vocab=vocab)

    def requests(step: int) -> list[RequestState]:
        return [RequestState(str(r), 1, [1], kinds[r % len(kinds)], torch.Generator().manual_seed(100 * step + r))
                for r in range(R)]

    def distributions(reqs):  # every row through distributions
        settings = torch.tensor([[r.sampling.temperature, r.sampling.top_k, r.sampling.top_p] for r in reqs])
        settings = settings.repeat_interleave(K + 1, 0)  # (R (K+1), 3)
        target_probs = logits_to_probs_rows(logits, settings[:, 0], settings[:, 1].long(), settings[:, 2]).view(
            R, K + 1, V)
        full_draft = block.probs_over_vocabulary(list(range(R)), K, V)  # (R, K, V)
        out = rejection_sample(draft_tokens, torch.full((R,), K), full_draft, target_probs, [r.generator for r in reqs])
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
    kind = " greedy" if args.greedy else f" temperature {args.temperature:g}" if args.temperature is not None \
        else " mixed settings"
    print(f"R={R} K={K} V={V}{kind}{f' W={W}' if vocab is not None else ''}: every row through distributions "
          f"{before:.1f} ms, the step's verification {now:.1f} ms ({before / now:.1f}x less; median of {args.steps}), "
          f"same tokens: {same}")


if __name__ == "__main__":
    main()
