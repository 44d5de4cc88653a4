"""A draft-vocabulary DSpark checkpoint and its SGLang export draft the same on real prompts (CPU, no SGLang).

`dspark export --to sglang` writes a draft-vocabulary checkpoint over the full vocabulary with one more Markov
rank that masks the tokens outside the draft vocabulary (dspark.export.engines.mask_outside_draft_vocab). This
script loads both folders as drafters of the real target (the export read back as a full-vocabulary, rank r + 1
``Qwen3DSparkModel``, whose heads follow SGLang's formulas: tests/export/test_sglang_draft_vocab.py checks that
against SGLang's restated head code), decodes the packaged evaluation prompts greedily with each and compares
every proposal: draft tokens, draft probabilities (and their mass outside the draft vocabulary), confidence
logits, then the outputs and acceptance lengths.

usage: python scripts/sglang_vocab_check.py CKPT EXPORT [--target smollm2-135m] [--sets gsm8k,mt-bench]
       [--per-set 2] [--max-new-tokens 64] [--threads 1]
Prints one JSON line; exits 1 when a proposal or an output differs. Greedy only: at temperature > 0 each
drafter samples by inverse CDF with the same uniform, over W tokens in draft order here and over V in token-id
order in the export, so equal distributions give different (equally distributed) samples and the runs part.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


class Recording:
    """A drafter that records every DraftBlock it proposes."""

    def __init__(self, drafter) -> None:
        self.drafter, self.blocks = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, requests, max_tokens):
        block = self.drafter.propose(requests, max_tokens)
        self.blocks.append(block)
        return block


def main() -> int:
    from dspark.data.eval_sets import load_eval_dataset
    from dspark.drafters.dspark.drafter import load_dspark_drafter
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams
    from dspark.target.model import load_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("export")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sets", default="gsm8k,mt-bench")
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target(args.target)
    prompts = [target.encode_chat(s.prompt) for name in args.sets.split(",")
               for s in load_eval_dataset(name, None, args.per_set, args.seed).samples]
    ours = load_dspark_drafter(args.checkpoint, target)
    export = load_dspark_drafter(args.export, target)
    if ours.draft_vocab is None or export.draft_vocab is not None:
        raise SystemExit("expected a draft-vocabulary checkpoint and its full-vocabulary SGLang export")
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ours.draft_vocab] = False
    results = {}
    for name, drafter in (("ours", ours), ("export", export)):
        rec = Recording(drafter)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
        out = SpeculativeGenerator(target, rec).generate(prompts, sampling)
        results[name] = (rec.blocks, out)
    (blocks_a, out_a), (blocks_b, out_b) = results["ours"], results["export"]
    same_blocks = len(blocks_a) == len(blocks_b)  # greedy and lossless: the same outputs, so the same steps
    tokens_equal = max_prob_diff = max_conf_diff = max_outside = 0.0
    n_tokens = 0
    for a, b in zip(blocks_a, blocks_b):
        for r in range(a.tokens.shape[0]):
            n = int(a.num_tokens[r])
            same_blocks &= n == int(b.num_tokens[r])
            if n == 0:
                continue
            n_tokens += n
            tokens_equal += int((a.tokens[r, :n] == b.tokens[r, :n]).sum())
            V = outside.shape[0]  # our drafter reports over its draft vocabulary: both over V here
            pa, pb = a.probs_over_vocabulary([r], n, V)[0], b.probs_over_vocabulary([r], n, V)[0]  # (n, V)
            max_prob_diff = max(max_prob_diff, float((pa - pb).abs().max()))
            max_outside = max(max_outside, float(pb[:, outside].sum(-1).max()))
            if a.confidence_logits is not None:
                d = (a.confidence_logits[r, :n] - b.confidence_logits[r, :n]).abs().max()
                max_conf_diff = max(max_conf_diff, float(d))
    texts_equal = sum(x.output_ids == y.output_ids for x, y in zip(out_a, out_b))
    tau = {k: sum(o.stats.sum_acceptance_length for o in out) / max(1, sum(o.stats.num_steps for o in out))
           for k, (_, out) in results.items()}
    report = {
        "checkpoint": args.checkpoint, "export": args.export, "prompts": len(prompts), "sets": args.sets,
        "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "steps": len(blocks_a),
        "draft_tokens": n_tokens, "draft_tokens_equal": int(tokens_equal), "max_abs_draft_prob_diff": max_prob_diff,
        "max_draft_prob_outside_vocab": max_outside, "max_abs_confidence_logit_diff": max_conf_diff,
        "outputs_equal": texts_equal, "tau_ours": round(tau["ours"], 4), "tau_export": round(tau["export"], 4),
    }
    print(json.dumps(report))
    ok = same_blocks and tokens_equal == n_tokens and texts_equal == len(prompts) and max_outside == 0.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
