"""Independent draft models: tokenizer / vocabulary mismatch is a clear error."""


import pytest

from dspark.drafters.draft_lm.drafter import load_draft_model
from dspark.errors import IncompatibleModelsError
from tests.tiny import save_hf_folder, save_word_tokenizer, tiny_config


def test_vocab_mismatch_without_tokenizer(tmp_path, tiny):
    folder = save_hf_folder(tmp_path / "draft", tiny_config(vocab_size=tiny.vocab_size + 8))
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        load_draft_model(str(folder), tiny)


def test_same_vocab_loads(tmp_path, tiny):
    folder = save_hf_folder(tmp_path / "draft", tiny_config())
    drafter = load_draft_model(str(folder), tiny, block_size=3)
    assert drafter.block_size == 3


@pytest.mark.slow
def test_tokenizer_mismatch_with_smollm2(tmp_path, smollm2):
    folder = save_hf_folder(tmp_path / "draft", tiny_config(vocab_size=smollm2.vocab_size))
    save_word_tokenizer(folder, 101)
    with pytest.raises(IncompatibleModelsError, match="tokenizer"):
        load_draft_model(str(folder), smollm2)


def test_a_batch_drafts_what_each_request_drafts_alone(tmp_path, tiny):
    """The draft LM drafts all requests of a position in one forward and one sampling call: each request gets the
    tokens it gets alone (its own settings, its own generator), greedy rows leave their draft_probs 0 and sampled
    rows carry the distribution (over the target's vocabulary) they were drawn from."""
    import torch

    from dspark.sampling.processing import SamplingParams

    from .tiny_drafters import random_tokens, request_after

    folder = save_hf_folder(tmp_path / "draft", tiny_config(), seed=3)
    settings = [SamplingParams(temperature=0.0, max_new_tokens=8),
                SamplingParams(temperature=1.0, max_new_tokens=8, seed=5),
                SamplingParams(temperature=0.8, top_k=4, max_new_tokens=8, seed=6)]

    def requests():
        return [request_after(tiny, random_tokens(n, seed=40 + n), [], s) for n, s in zip((4, 8, 6), settings)]

    want = [3, 2, 3]
    alone = [load_draft_model(str(folder), tiny, 3).propose([req], [n]) for req, n in zip(requests(), want)]
    batch = load_draft_model(str(folder), tiny, 3).propose(requests(), want)
    for r, one in enumerate(alone):
        n = want[r]
        assert torch.equal(batch.tokens[r, :n], one.tokens[0, :n]), r
        assert torch.allclose(batch.draft_probs[r, :n], one.draft_probs[0, :n], atol=1e-6), r
    assert torch.equal(batch.draft_probs[0], torch.zeros_like(batch.draft_probs[0]))
    assert batch.draft_probs[1, :2].sum(-1).allclose(torch.ones(2))
    assert (batch.draft_probs[2] > 0).sum(-1).le(4).all()
