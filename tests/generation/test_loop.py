"""The speculative loop: exact greedy equality, batching, seeds, stop handling."""

import pytest
import torch

from dspark.drafters.base import NoDrafter
from dspark.drafters.draft_lm.drafter import DraftModelDrafter
from dspark.drafters.prompt_lookup import PromptLookupDrafter, lookup_continuation
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from tests.tiny import tiny_target

PROMPTS = [[5, 9, 13, 5, 9], [7, 7, 8, 20, 31, 44, 7, 7], [60]]


def plain(target, prompts, sp):
    return [r.output_ids for r in SpeculativeGenerator(target, NoDrafter(target.vocab_size)).generate(prompts, sp)]


def test_lookup_continuation_prefers_longest_recent_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_continuation(toks, max_ngram=3, min_ngram=1, max_tokens=2) == [7, 8]
    assert lookup_continuation([4, 5, 6], 3, 1, 5) == []


@pytest.mark.parametrize("block_size", [1, 3, 7])
@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_lookup_greedy_equals_plain_greedy(block_size, batch):
    target = tiny_target(seed=1)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    prompts = PROMPTS[:batch]
    ref = plain(target, prompts, sp)
    gen = SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, block_size))
    out = gen.generate(prompts, sp)
    assert [r.output_ids for r in out] == ref
    # tiny random models repeat themselves, so lookup drafts do get accepted
    assert sum(r.stats.num_accepted for r in out) > 0


@pytest.mark.parametrize("block_size", [2, 5])
def test_draft_model_greedy_equals_plain_greedy(block_size):
    target = tiny_target(seed=2)
    other = tiny_target(seed=3).model  # a different random model with the same vocabulary
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    ref = plain(target, PROMPTS, sp)
    for draft_lm in (other, target.model):
        out = SpeculativeGenerator(target, DraftModelDrafter(draft_lm, target.vocab_size, block_size)).generate(PROMPTS, sp)
        assert [r.output_ids for r in out] == ref
    # drafting with the target itself is accepted every time: tau = block + 1 except at the end
    s = out[0].stats
    assert s.acceptance_length > block_size * 0.8


def test_seed_reproduces_and_batch_does_not_matter():
    target = tiny_target(seed=4, sharp=1.0)
    drafter = PromptLookupDrafter(target.vocab_size, 4)
    sp = [SamplingParams(temperature=1.0, max_new_tokens=25, seed=s) for s in (11, 12, 13)]
    gen = SpeculativeGenerator(target, drafter)
    together = [r.output_ids for r in gen.generate(PROMPTS, sp)]
    again = [r.output_ids for r in gen.generate(PROMPTS, sp)]
    alone = [gen.generate([p], [s])[0].output_ids for p, s in zip(PROMPTS, sp)]
    assert together == again == alone
    other_seed = gen.generate(PROMPTS[:1], [SamplingParams(temperature=1.0, max_new_tokens=25, seed=99)])
    assert other_seed[0].output_ids != together[0]


def test_stops_on_eos_and_max_tokens():
    target = tiny_target(seed=5)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    ref = plain(target, PROMPTS, sp)[0]
    # make the 4th greedy token a stop token: output must end right there
    stop = ref[3]
    sp_stop = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])
    for drafter in (NoDrafter(target.vocab_size), PromptLookupDrafter(target.vocab_size, 5)):
        out = SpeculativeGenerator(target, drafter).generate(PROMPTS[:1], sp_stop)[0]
        assert out.output_ids == ref[: ref.index(stop) + 1]
        assert out.finish_reason == "stop"
    out = SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, 7)).generate(PROMPTS[:1], sp)[0]
    assert len(out.output_ids) == 12 and out.finish_reason == "length"


def test_sampled_first_tokens_follow_target():
    """The loop (not just the sampler) is lossless: first two sampled tokens vs the target's own."""
    target = tiny_target(seed=6, sharp=0.5, vocab_size=16, eos_token_id=999)  # no stop token
    prompt = [3, 4, 3, 4, 3]
    n = 3000
    sp = [SamplingParams(temperature=1.0, max_new_tokens=2, seed=i) for i in range(n)]
    out = SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, 3)).generate([prompt] * n, sp)
    second = torch.tensor([r.output_ids[1] for r in out])
    first = torch.tensor([r.output_ids[0] for r in out])
    # exact second-token marginal: Σ_x p(x) p(. | x)
    with torch.inference_mode():
        p1 = torch.softmax(target.forward(torch.tensor(prompt), [5], None).logits[-1], -1)
        ctx = torch.tensor([prompt + [x] for x in range(16)]).flatten()
        p2 = torch.softmax(target.forward(ctx, [6] * 16, None, logits_for="last").logits, -1)
    marg2 = (p1[:, None] * p2).sum(0)
    tv1 = 0.5 * (torch.bincount(first, minlength=16) / n - p1).abs().sum()
    tv2 = 0.5 * (torch.bincount(second, minlength=16) / n - marg2).abs().sum()
    # sampling noise for V=16, n=3000: E[TV] ~ 0.03; 0.07 is > 4 standard deviations
    assert tv1 < 0.07 and tv2 < 0.07, (tv1, tv2)


def test_the_loop_takes_a_verify_policy_bare_or_adapted():
    """``speculative_step`` runs any ``VerifyPolicy``; a bare one reads plain-sigmoid confidences."""
    from dspark.scheduler.confidence import ConfidenceAdapter
    from dspark.scheduler.policies import FixedLength

    target = tiny_target(seed=2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=30)
    ref = plain(target, PROMPTS, sp)
    drafter = DraftModelDrafter(target.model, target.vocab_size, 4)  # always accepted: verify length shows
    for policy in (FixedLength(1), ConfidenceAdapter(FixedLength(1))):
        out = SpeculativeGenerator(target, drafter, policy=policy).generate(PROMPTS, sp)
        assert [r.output_ids for r in out] == ref
        assert all(r.stats.counts[p][a] == 0 for r in out for p in range(2, 5) for a in range(p + 1))
        assert sum(r.stats.num_accepted for r in out) > 0
