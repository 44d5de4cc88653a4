"""Hybrid drafting (prompt lookup where the context repeats, DSpark elsewhere): exact proposals, lossless."""

import pytest
import torch

from dspark.drafters.base import NoDrafter
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.hybrid import HybridDrafter, HybridTrack
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams
from tests.drafters.tiny_drafters import LAYER_IDS, request_after, tiny_dspark
from tests.sampling.stats import goodness_of_fit
from tests.tiny import tiny_target


def _hybrid(target, **kw) -> HybridDrafter:
    return HybridDrafter(DSparkDrafter(tiny_dspark(target)), target.vocab_size, **kw)


def test_rows_with_a_repeated_ngram_draft_the_lookup_the_others_draft_dspark(tiny):
    hybrid = _hybrid(tiny, min_ngram=2)
    repeated = [5, 9, 13, 40, 5, 9]  # "5 9" occurred before: continuation 13 40 5 9
    fresh = [5, 9, 13, 40, 41, 42]  # no earlier "41 42" nor "42"
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, seed=3)
    reqs = [request_after(tiny, t, LAYER_IDS, sp) for t in (repeated, fresh)]
    block = hybrid.propose(reqs, [4, 4])
    assert block.tokens[0, :4].tolist() == [13, 40, 5, 9] and block.num_tokens[0] == 4
    assert torch.equal(block.draft_probs[0].argmax(-1), block.tokens[0]) and torch.all(block.draft_probs[0].sum(-1) == 1)
    # the second row is exactly what DSpark alone proposes with the same generator state
    alone = hybrid.model_drafter.propose([request_after(tiny, fresh, LAYER_IDS, sp)], [4])
    assert torch.equal(block.tokens[1], alone.tokens[0])
    torch.testing.assert_close(block.draft_probs[1], alone.draft_probs[0])
    torch.testing.assert_close(block.confidence_logits[1], alone.confidence_logits[0])
    assert torch.all(block.confidence_logits[0] == hybrid.lookup_confidence_logit)
    assert (hybrid.lookup_steps, hybrid.model_steps) == (1, 1)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_plain_greedy(tiny, batch):
    prompts = [[5, 9, 13, 5, 9, 13, 5], [7, 7, 8, 20, 31, 44, 7, 7], [60, 61]][:batch]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = [r.output_ids for r in SpeculativeGenerator(tiny, NoDrafter(tiny.vocab_size)).generate(prompts, sp)]
    hybrid = _hybrid(tiny, min_ngram=1)
    out = [r.output_ids for r in SpeculativeGenerator(tiny, hybrid).generate(prompts, sp)]
    assert out == plain
    assert hybrid.lookup_steps > 0 and hybrid.model_steps > 0


def _joint_of_drafted_tokens(target, prompt: list[int], V: int) -> torch.Tensor:
    """Exact P(x2, x3) of the 2nd and 3rd sampled tokens (the ones that go through drafting): (V*V,)."""
    with torch.inference_mode():
        p1 = torch.softmax(target.forward(torch.tensor(prompt), [len(prompt)], None).logits[-1], -1)  # (V,)
        ctx2 = torch.tensor([prompt + [a] for a in range(V)]).flatten()
        p2 = torch.softmax(target.forward(ctx2, [len(prompt) + 1] * V, None, logits_for="last").logits, -1)  # (V, V)
        ctx3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)]).flatten()
        p3 = torch.softmax(target.forward(ctx3, [len(prompt) + 2] * V * V, None, logits_for="last").logits, -1)
    joint = p1[:, None, None] * p2[:, :, None] * p3.view(V, V, V)  # (x1, x2, x3)
    return joint.sum(0).flatten()


@pytest.mark.parametrize("lossy", [False, True])
def test_sampled_tokens_follow_the_target(lossy):
    """Joint law of the drafted-and-verified tokens 2..3 vs the target's (chi-square + TV bound); the negative
    control reports a uniform distribution for lookup rows instead of the one-hot it sampled from."""
    V = 12
    target = tiny_target(seed=6, sharp=0.5, vocab_size=V, eos_token_id=999)
    prompt = [3, 4, 3, 4, 3]
    hybrid = HybridDrafter(DSparkDrafter(tiny_dspark(target)), V, min_ngram=2)
    if lossy:
        inner = hybrid.propose

        def biased(requests, max_tokens):
            block = inner(requests, max_tokens)
            onehot = block.draft_probs.amax(-1) == 1.0  # lookup rows
            block.draft_probs[onehot] = 1.0 / V
            return block

        hybrid.propose = biased
    n = 6000
    sp = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=i) for i in range(n)]
    out = SpeculativeGenerator(target, hybrid).generate([prompt] * n, sp)
    pairs = torch.tensor([r.output_ids[1] * V + r.output_ids[2] for r in out])
    fit = goodness_of_fit(pairs, _joint_of_drafted_tokens(target, prompt, V))
    assert hybrid.lookup_steps > 0 and hybrid.model_steps > 0
    assert hybrid.short_lookup_steps > 0  # the adaptive choice on 1-gram matches was exercised too
    if lossy:
        assert not fit.passes and fit.p_value < 1e-9, fit  # chi-square rejects far beyond the bound
    else:
        assert fit.passes, fit


def test_load_drafter_wraps_a_checkpoint_when_asked(tiny, tmp_path):
    from dspark.drafters.options import DraftingOptions
    from dspark.drafters.registry import load_drafter

    tiny_dspark(tiny).save_checkpoint(tmp_path)
    plain = load_drafter(str(tmp_path), tiny)
    hybrid = load_drafter(str(tmp_path), tiny, DraftingOptions(hybrid=True, hybrid_min_ngram=2))
    assert isinstance(hybrid, HybridDrafter) and not isinstance(plain, HybridDrafter)
    assert (hybrid.min_ngram, hybrid.block_size, hybrid.target_layer_ids) == (2, plain.block_size, plain.target_layer_ids)


def test_a_track_reads_the_accepted_drafts_off_the_committed_tokens():
    track = HybridTrack(last=("short", 4, [7, 8, 9]))
    track.observe([1, 2, 3, 6, 7, 8, 5, 2], alpha=0.5)  # drafts 7 8 accepted, 9 replaced by 5
    assert track.short_lookup == 1.0 + 0.5 * (2 - 1.0) and track.model == 1.0 and track.last is None
    track.last = ("model", 4, [3, 7])
    track.observe([1, 2, 3, 6, 7, 8, 5, 2], alpha=0.5)  # the first draft already differs
    assert track.model == 0.5
    track.last = ("long", 4, [9])
    track.observe([1, 2, 3, 6, 9], alpha=0.5)  # long matches are always drafted: nothing to learn
    assert (track.short_lookup, track.model) == (1.5, 0.5)


def test_a_short_match_is_drafted_only_while_it_pays_more_than_the_trained_drafter(tiny):
    hybrid = _hybrid(tiny, min_ngram=3, draft_cost=0.2)
    short_only = [5, 9, 13, 40, 41, 9]  # "9" occurred before (continuation 13 40 41 9); no earlier "41 9"
    sp = SamplingParams(temperature=1.0, max_new_tokens=32, seed=3)

    def source(short_lookup: float, model: float) -> str:
        req = request_after(tiny, short_only, LAYER_IDS, sp)
        req.hybrid_state = HybridTrack(short_lookup=short_lookup, model=model)
        block = hybrid.propose([req], [4])
        kind = req.hybrid_state.last[0]
        if kind == "short":
            assert block.tokens[0, :4].tolist() == [13, 40, 41, 9]
        return kind

    assert source(1.0, 1.0) == "short"  # a tie goes to the lookup, which costs no drafting time
    assert source(0.7, 1.0) == "short"  # (1 + 0.7) * 1.2 = 2.04 >= 2: still pays
    assert source(0.5, 1.0) == "model"  # 1.8 < 2: the trained drafter commits more per unit of time
    assert source(0.0, 3.0) == "model"
    static = _hybrid(tiny, min_ngram=3, adaptive=False)
    req = request_after(tiny, short_only, LAYER_IDS, sp)
    static.propose([req], [4])
    assert req.hybrid_state.last[0] == "model" and static.short_lookup_steps == 0


def test_bad_adaptive_settings_are_refused(tiny):
    with pytest.raises(ValueError, match="draft_cost"):
        _hybrid(tiny, draft_cost=-0.1)
    with pytest.raises(ValueError, match="alpha"):
        _hybrid(tiny, alpha=0.0)
