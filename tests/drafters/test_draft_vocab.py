"""Draft vocabularies: the file, and DSpark/DFlash drafting inside one (lossless, cheaper).

Counting a tokenized set and the `dspark data vocab` command: tests/data/test_vocab.py."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import NoDrafter
from dspark.drafters.draft_vocab import load_draft_vocab, save_draft_vocab
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.errors import DSparkError
from dspark.generation.generator import SpeculativeGenerator
from dspark.sampling.processing import SamplingParams

from .tiny_drafters import LAYER_IDS, overfit_on_greedy, random_tokens, request_after, tiny_dflash, tiny_dspark


def test_file_round_trip_and_errors(tmp_path):
    path = save_draft_vocab(tmp_path / "v.json", [5, 2, 9], 96, 0.9, "somewhere")
    assert load_draft_vocab(path, 96) == [5, 2, 9]
    with pytest.raises(DSparkError, match="vocabulary of 96"):
        load_draft_vocab(path, 100)
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(DSparkError, match="dspark data vocab"):
        load_draft_vocab(tmp_path / "bad.json", 96)


@pytest.mark.parametrize("make", [tiny_dspark, tiny_dflash], ids=["dspark", "dflash"])
def test_drafts_stay_inside_the_vocab_and_decoding_stays_lossless(tiny, make):
    model = make(tiny)
    vocab, G = list(range(0, 96, 2)), model.config.block_size  # even ids only
    req = request_after(tiny, random_tokens(9, seed=3), LAYER_IDS, SamplingParams(temperature=1.0, seed=2))
    full = DSparkDrafter(model).propose([req], [G])
    for top_m in (None, 5):
        block = DSparkDrafter(model, head_top_m=top_m, draft_vocab=vocab).propose([req], [G])
        assert block.draft_probs.shape == (1, G, len(vocab)) and block.vocab.tolist() == vocab  # over W tokens
        probs = block.probs_over_vocabulary([0], G, 96)[0]  # (G, V)
        odd = probs[:, 1::2]
        assert torch.equal(odd, torch.zeros_like(odd)) and (block.tokens % 2 == 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(G))
        assert torch.equal(probs[:, ::2], block.draft_probs[0])
    if make is tiny_dflash:  # no head: slot distributions are the full ones renormalised on the vocab
        even = full.draft_probs[0, :, ::2]
        got = DSparkDrafter(model, draft_vocab=vocab).propose([req], [G]).draft_probs[0]
        torch.testing.assert_close(got, even / even.sum(-1, keepdim=True))
    everything = DSparkDrafter(model, draft_vocab=list(range(96))).propose([req], [G])
    torch.testing.assert_close(everything.probs_over_vocabulary([0], G, 96), full.draft_probs)
    assert full.vocab is None and torch.equal(full.probs_over_vocabulary([0], 2, 96), full.draft_probs[:, :2])

    prompts = [random_tokens(6, seed=13), random_tokens(11, seed=14)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = SpeculativeGenerator(tiny, NoDrafter(tiny.vocab_size)).generate(prompts, sp)
    overfit_on_greedy(tiny, model, prompts[0])
    fast = SpeculativeGenerator(tiny, DSparkDrafter(model, head_top_m=4, draft_vocab=vocab)).generate(prompts, sp)
    assert [r.output_ids for r in fast] == [r.output_ids for r in plain]
