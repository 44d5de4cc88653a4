"""The paths of a speculative step that skip work: greedy requests verified by argmax (``greedy_verify``, no
distributions), and prompt pieces fed in a decode step's target pass (``speculative_step(prefill=...)``)."""

from __future__ import annotations

import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.generation.step import _verify, greedy_verify
from dspark.sampling.processing import SamplingParams, logits_to_probs
from dspark.sampling.rejection import rejection_sample

V = 50


def _batch(seed: int, R: int = 6, K: int = 4):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, K + 1, (R,), generator=g).tolist()  # verify_len per request
    logits = torch.randn(sum(n + 1 for n in lens), V, generator=g) * 3  # (N, V)
    best = logits.argmax(-1)
    drafted = torch.randint(0, V, (R, K), generator=g)
    offset = 0
    for r, n in enumerate(lens):  # drafts that follow the argmax for a while, then leave it
        keep = int(torch.randint(0, n + 1, (1,), generator=g))
        drafted[r, :keep] = best[offset : offset + keep]
        offset += n + 1
    draft_probs = torch.softmax(torch.randn(R, K, V, generator=g), -1)
    draft_probs.scatter_(-1, drafted[..., None], 0.5)  # every draft has probability > 0, as sampled drafts do
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    return lens, logits, drafted, draft_probs


def test_greedy_verify_is_rejection_sampling_of_a_one_hot_target():
    for seed in range(30):
        lens, logits, drafted, draft_probs = _batch(seed)
        R, K = drafted.shape
        accepted, committed = greedy_verify(logits, [n + 1 for n in lens], drafted)
        target = torch.zeros(R, K + 1, V)
        offset = 0
        for r, n in enumerate(lens):
            target[r, : n + 1] = logits_to_probs(logits[offset : offset + n + 1], 0.0)
            offset += n + 1
        ref = rejection_sample(drafted, torch.tensor(lens), draft_probs, target,
                               [torch.Generator().manual_seed(r) for r in range(R)])
        assert accepted == ref.num_accepted.tolist()
        assert committed == [row[: a + 1] for row, a in zip(ref.output_tokens.tolist(), accepted)]


def test_greedy_verify_commits_the_argmax_after_the_last_accepted_draft():
    logits = torch.full((3, V), -1.0)
    logits[0, 7], logits[1, 8], logits[2, 9] = 5.0, 5.0, 5.0  # argmax 7, 8, 9
    assert greedy_verify(logits, [3], torch.tensor([[7, 8]])) == ([2], [[7, 8, 9]])
    assert greedy_verify(logits, [3], torch.tensor([[7, 3]])) == ([1], [[7, 8]])
    assert greedy_verify(logits, [3], torch.tensor([[3, 8]])) == ([0], [[7]])
    assert greedy_verify(logits[:1], [1], None) == ([0], [[7]])
    tied = torch.zeros(1, V, dtype=torch.bfloat16)
    tied[0, 30] = tied[0, 12] = 2.0  # the first of tied maxima, as argmax and the one-hot target take it
    assert greedy_verify(tied, [1], None) == ([0], [[12]])


def test_a_request_gets_the_same_result_alone_and_in_a_mixed_batch():
    settings = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(0.0),
                SamplingParams(1.0, top_p=0.8), SamplingParams(0.0)]
    for seed in range(10):
        lens, logits, drafted, draft_probs = _batch(seed)
        R, K = drafted.shape

        def requests(rows):
            return [RequestState(str(r), 1, [1], settings[r], torch.Generator().manual_seed(1000 * seed + r))
                    for r in rows]

        block = DraftBlock(drafted, torch.tensor(lens), draft_probs)
        together = _verify(logits, requests(range(R)), [n + 1 for n in lens], drafted, block, V)
        offset = 0
        for r, n in enumerate(lens):
            alone_block = DraftBlock(drafted[r : r + 1], torch.tensor([n]), draft_probs[r : r + 1])
            alone = _verify(logits[offset : offset + n + 1], requests([r]), [n + 1], drafted[r : r + 1],
                            alone_block, V)
            assert (together[0][r], together[1][r]) == (alone[0][0], alone[1][0]), (seed, r)
            offset += n + 1


def test_a_prompt_fed_in_a_decode_steps_pass_gives_what_a_pass_of_its_own_gives():
    """``speculative_step(prefill=...)``: the pieces' caches, context features and first tokens are a separate
    ``prefill``'s (bfloat16 rows do not depend on the batch), and the decoding request's step is unchanged."""
    from dspark.drafters.base import NoDrafter
    from dspark.generation.step import PrefillPieces, prefill, speculative_step
    from tests.tiny import tiny_target

    target = tiny_target(seed=3)
    target.model.to(torch.bfloat16)
    drafter = NoDrafter(target.vocab_size, target_layer_ids=[0, 1])

    def fresh(prompt, seed):
        return RequestState("r", len(prompt), list(prompt), SamplingParams(1.0), torch.Generator().manual_seed(seed))

    def run(mixed: bool):
        decoding = fresh([3, 4, 5, 6, 7], 0)
        dcache = target.new_cache(64)
        prefill(target, [decoding], [dcache], drafter.target_layer_ids)
        waiting = [fresh([9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7], 1), fresh([11, 12, 13], 2)]
        wcaches = [target.new_cache(64) for _ in waiting]
        results = []
        for counts in ([5, 0], [7, 3]):  # the first prompt in two pieces, the second whole in the second pass
            rows = [i for i, n in enumerate(counts) if n]
            pieces = PrefillPieces([waiting[i] for i in rows], [wcaches[i] for i in rows], [counts[i] for i in rows])
            if mixed:
                outcomes, timings = speculative_step(target, drafter, [decoding], [dcache], prefill=pieces)
                complete = timings.prefill_complete
            else:
                complete = prefill(target, pieces.requests, pieces.caches, drafter.target_layer_ids, pieces.counts)
                outcomes, _ = speculative_step(target, drafter, [decoding], [dcache])
            results.append((complete, outcomes[0].new_tokens))
        return results, decoding, waiting, wcaches

    got, want = run(True), run(False)
    assert got[0] == want[0] == [([False], got[0][0][1]), ([True, True], got[0][1][1])]
    for a, b in zip([got[1]] + got[2], [want[1]] + want[2]):
        assert a.tokens == b.tokens
        assert torch.equal(a.context_features, b.context_features)
    for a, b in zip(got[3], want[3]):
        assert a.length == b.length
        assert torch.equal(a.keys[:, :, : a.length], b.keys[:, :, : b.length])
