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


# ---------------------------------------------------------------- mutants the tests above must not let through
class PeekingHybrid(HybridDrafter):
    """Mutant: keeps a short lookup only when the trained drafter's first sampled token agrees with it. The
    choice then reads a draft sampled this step (DESIGN §2b (c)): biased, though each row reports its source's
    exact distribution."""

    def _choose(self, req, max_tokens):
        source, cont = super()._choose(req, max_tokens)
        if source == "short":
            peek = self.model_drafter.propose([req], [min(max_tokens, self.block_size)])
            if int(peek.num_tokens[0]) == 0 or int(peek.tokens[0, 0]) != cont[0]:
                return "model", []
        return source, cont


def _misplacing(hybrid: HybridDrafter) -> HybridDrafter:
    """Mutant: a lookup row's one-hot at draft position k >= 1 is put on the token of position k - 1."""
    inner = hybrid.propose

    def propose(requests, max_tokens):
        block = inner(requests, max_tokens)
        for r in range(block.tokens.shape[0]):
            n = int(block.num_tokens[r])
            if n >= 2 and bool((block.draft_probs[r, :n].amax(-1) == 1.0).all()):  # a lookup row
                block.draft_probs[r, 1:n] = 0.0
                block.draft_probs[r, torch.arange(1, n), block.tokens[r, : n - 1]] = 1.0
        return block

    hybrid.propose = propose
    return hybrid


def small_vocab_target():
    return tiny_target(seed=6, sharp=0.5, vocab_size=12, eos_token_id=999)


def _choice_histories(target) -> list[tuple[list[int], HybridTrack]]:
    """Histories that reach every branch of the choice: long matches, short ones on both sides of the
    adaptive threshold, and none. Tokens from a small alphabet so that matches are common."""
    g = torch.Generator().manual_seed(11)
    tracks = [(1.0, 1.0), (0.7, 1.0), (0.5, 1.0), (0.0, 3.0), (2.0, 0.5), (0.66, 1.0)]
    out = []
    for i in range(36):
        tokens = torch.randint(5, 11, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
        short, model = tracks[i % len(tracks)]
        out.append((tokens, HybridTrack(short_lookup=short, model=model)))
    out.append(([5, 9, 3, 4, 1, 9], HybridTrack()))  # a short match only
    out.append(([0, 1, 2, 3], HybridTrack()))  # no match
    return out


def _choices(make_hybrid, target, seeds=range(6)) -> list[set[str]]:
    """For each history, the sources the hybrid chose under each drafter seed (the same committed tokens and
    track, only the generator that samples this step's drafts differs)."""
    import copy

    hybrid = make_hybrid()
    seen = []
    for tokens, track in _choice_histories(target):
        sources = set()
        for seed in seeds:
            req = request_after(target, tokens, LAYER_IDS, SamplingParams(temperature=1.0, max_new_tokens=32, seed=seed))
            req.hybrid_state = copy.deepcopy(track)
            hybrid.propose([req], [4])
            sources.add(req.hybrid_state.last[0])
        seen.append(sources)
    return seen


@pytest.mark.parametrize("min_ngram, adaptive", [(3, True), (2, True), (3, False), (1, True)])
def test_the_choice_does_not_depend_on_this_steps_drafts(min_ngram, adaptive):
    """Same history, different drafter seeds: the same source, for every branch of the choice. V = 12, so the
    trained drafter's first token often equals a lookup's (what a peeking choice would react to)."""
    target = small_vocab_target()
    seen = _choices(lambda: _hybrid(target, min_ngram=min_ngram, adaptive=adaptive), target)
    assert all(len(s) == 1 for s in seen), seen
    reached = set().union(*seen)
    assert "model" in reached and ("short" in reached or not adaptive or min_ngram == 1), reached
    assert "long" in reached


def test_negative_control_a_peeking_choice_is_caught_by_the_invariance_check():
    target = small_vocab_target()
    seen = _choices(lambda: PeekingHybrid(DSparkDrafter(tiny_dspark(target)), target.vocab_size, min_ngram=3), target)
    assert any(len(s) > 1 for s in seen)


def successor_target(V: int = 12, peak: float = 0.6, repeat: float = 0.5, seed: int = 6):
    """A tiny target that continues k with k + 1 (mod V) or with k again, each with p ~ 0.3-0.5: the first is
    the continuation prompt lookup finds in ``list(range(V)) + [0]``, so lookup drafts are often accepted and
    their 2nd position verified; the second makes a wrong report at that position costly (see below)."""
    target = tiny_target(seed=seed, sharp=1.0, vocab_size=V, eos_token_id=999)
    with torch.no_grad():
        for name, p in target.model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.1)  # the layers perturb the residual stream (the token's embedding) a little
        emb = target.model.model.embed_tokens.weight
        emb.copy_(torch.nn.functional.normalize(emb, dim=-1) * 5.7)  # RMS 1 after the final norm
        # row j reads token j - 1 (successor) and token j (repeat)
        target.model.lm_head.weight.copy_((torch.roll(emb, 1, 0) * peak + emb * repeat) / 5.7)
    return target


@pytest.mark.parametrize("mutant", [None, "misplaced-one-hot", "uniform-lookup-probs"])
def test_two_lookup_drafts_per_step_follow_the_target(mutant):
    """Short matches dominate (min_ngram 3; every token occurs once in the prompt, so the context's last token
    always has an earlier 1-gram match whose continuation is 2 tokens long) and the first cycle drafts 2
    lookup tokens (max_new_tokens 4): the (x2, x3) joint checks the second draft position too. Controls: a
    one-hot at the wrong position for k >= 1 (invisible when one token is drafted per step), and lookup rows
    reporting a uniform distribution."""
    V = 12
    target = successor_target(V)
    prompt = list(range(V)) + [0]
    hybrid = HybridDrafter(DSparkDrafter(tiny_dspark(target)), V, min_ngram=3)
    lengths = []
    inner = hybrid.propose

    def counted(requests, max_tokens):
        block = inner(requests, max_tokens)
        lengths.extend(int(n) for n, r in zip(block.num_tokens, requests) if r.hybrid_state.last[0] != "model")
        return block

    hybrid.propose = counted
    if mutant == "misplaced-one-hot":
        _misplacing(hybrid)
    elif mutant == "uniform-lookup-probs":
        wrapped = hybrid.propose

        def uniform(requests, max_tokens):
            block = wrapped(requests, max_tokens)
            block.draft_probs[block.draft_probs.amax(-1) == 1.0] = 1.0 / V
            return block

        hybrid.propose = uniform
    n = 6000
    sp = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=i) for i in range(n)]
    out = SpeculativeGenerator(target, hybrid).generate([prompt] * n, sp)
    pairs = torch.tensor([r.output_ids[1] * V + r.output_ids[2] for r in out])
    fit = goodness_of_fit(pairs, _joint_of_drafted_tokens(target, prompt, V))
    assert hybrid.short_lookup_steps > 0.5 * n  # short matches dominate
    assert sum(k >= 2 for k in lengths) > 0.5 * n  # and draft two tokens
    if mutant:
        assert not fit.passes and fit.p_value < 1e-9, fit
    else:
        assert fit.passes, fit
