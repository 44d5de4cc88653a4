"""The readers a verify step hands the rejection sampler (``TargetRows``, ``DraftBlock.rows``): each value they give
is, bit for bit, what the whole tensors they stand for hold, and the sampler reading them gives the tokens and
generator states it gives those tensors."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.base import DraftBlock
from dspark.sampling import rows as rows_module
from dspark.sampling.processing import SamplingParams, logits_to_probs
from dspark.sampling.rejection import DenseRows, rejection_sample, rejection_sample_rows
from dspark.sampling.rows import TargetRows

V = 50
SETTINGS = [SamplingParams(1.0, top_p=0.9), SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=5),
            SamplingParams(0.5, top_k=80, top_p=0.8), SamplingParams(1.3)]


def _batch(seed: int, K: int = 4):
    g = torch.Generator().manual_seed(seed)
    R = len(SETTINGS)
    lens = torch.randint(0, K + 1, (R,), generator=g).tolist()  # verify_len per request
    lens[0] = K  # the widest request sets K
    logits = (torch.randn(sum(n + 1 for n in lens), V, generator=g) * 3).to(torch.bfloat16)  # (N, V) as a target
    dense = torch.zeros(R, K + 1, V)  # what the readers stand for: each request's rows by logits_to_probs
    offset = 0
    for r, (s, n) in enumerate(zip(SETTINGS, lens)):
        dense[r, : n + 1] = logits_to_probs(logits[offset : offset + n + 1], s.temperature, s.top_k, s.top_p)
        offset += n + 1
    return lens, logits, dense


@pytest.fixture(params=[1 << 19, V * 3, V], ids=["one-chunk", "chunks-across-requests", "a-row-per-chunk"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(rows_module, "CHUNK_ELEMENTS", request.param)


def test_target_rows_read_what_each_request_alone_gives(chunk):
    for seed in range(5):
        lens, logits, dense = _batch(seed)
        R, K = len(lens), max(lens)
        target = TargetRows(logits, SETTINGS, [n + 1 for n in lens])
        tokens = torch.randint(0, V, (R, K), generator=torch.Generator().manual_seed(seed))
        got = target.at(tokens)  # (R, K)
        for r, n in enumerate(lens):
            assert torch.equal(got[r, :n], dense[r, :n].gather(-1, tokens[r, :n, None]).squeeze(-1)), (seed, r)
            assert not got[r, n:].any()  # past its drafts: nothing read
        for k in range(K + 1):
            index = torch.tensor([min(k, n) for n in lens])
            assert torch.equal(target.rows(index), dense[torch.arange(R), index])


def test_target_rows_refuse_rows_that_do_not_add_up():
    with pytest.raises(ValueError, match="rows"):
        TargetRows(torch.zeros(5, V), SETTINGS[:2], [2, 2])


@pytest.mark.parametrize("with_vocab", [False, True], ids=["over-V", "draft-vocabulary"])
def test_draft_rows_read_the_block_over_the_vocabulary(with_vocab):
    g = torch.Generator().manual_seed(3)
    R, K = 5, 4
    vocab = torch.randperm(V, generator=g)[:20] if with_vocab else None  # unsorted, as a draft vocabulary may be
    width = V if vocab is None else len(vocab)
    probs = torch.softmax(torch.randn(R, K + 2, width, generator=g), -1)  # the block may hold more positions
    entries = torch.multinomial(probs[:, :K].reshape(-1, width), 1, generator=g).reshape(R, K)
    tokens = entries if vocab is None else vocab[entries]
    block = DraftBlock(tokens, torch.full((R,), K), probs, vocab=vocab)
    rows = [4, 1, 2]
    full = block.probs_over_vocabulary(rows, K, V)  # (3, K, V)
    reader = block.rows(rows, K, V)
    asked = tokens[rows].clone()
    if vocab is not None:  # a token outside the draft vocabulary has draft probability 0
        asked[0, 1] = next(t for t in range(V) if t not in vocab.tolist())
    assert torch.equal(reader.at(asked), full.gather(-1, asked[..., None]).squeeze(-1))
    index = torch.tensor([3, 0, 2])
    assert torch.equal(reader.rows(index), full[torch.arange(3), index])


def test_the_sampler_reading_rows_gives_what_it_gives_the_dense_tensors(chunk):
    for seed in range(20):
        lens, logits, dense = _batch(seed)
        R, K = len(lens), max(lens)
        g = torch.Generator().manual_seed(100 + seed)
        vocab = torch.randperm(V, generator=g)[:30]
        draft = torch.softmax(torch.randn(R, K, 30, generator=g), -1)  # over the draft vocabulary
        entries = torch.multinomial(draft.reshape(-1, 30), 1, generator=g).reshape(R, K)
        block = DraftBlock(vocab[entries], torch.tensor(lens), draft, vocab=vocab)
        gens = [[torch.Generator().manual_seed(1000 * seed + r) for r in range(R)] for _ in range(2)]
        want = rejection_sample(block.tokens, torch.tensor(lens), block.probs_over_vocabulary(list(range(R)), K, V),
                                dense, gens[0])
        got = rejection_sample_rows(block.tokens, torch.tensor(lens), block.rows(list(range(R)), K, V),
                                    TargetRows(logits, SETTINGS, [n + 1 for n in lens]), gens[1])
        assert torch.equal(got.output_tokens, want.output_tokens), seed
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(*gens))


def test_the_rows_sampler_refuses_verify_lengths_past_its_drafts():
    probs = DenseRows(torch.full((1, 3, V), 1.0 / V))
    with pytest.raises(ValueError, match="num_draft"):
        rejection_sample_rows(torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), probs, probs, [None])


class _OneRowOff(TargetRows):
    """A mutant reader: every request's rows read one logits row later (the next position, or the next request's)."""

    def __init__(self, logits, settings, seq_lens):
        super().__init__(torch.cat([logits, logits[-1:]]), settings, seq_lens[:-1] + [seq_lens[-1] + 1])
        self.seq_lens = seq_lens
        self.starts = self.starts + 1


def test_negative_control_a_reader_one_row_off_is_caught():
    differs = 0
    for seed in range(20):
        lens, logits, dense = _batch(seed)
        R, K = len(lens), max(lens)
        g = torch.Generator().manual_seed(100 + seed)
        draft = torch.softmax(torch.randn(R, K, V, generator=g), -1)
        tokens = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(R, K)
        block = DraftBlock(tokens, torch.tensor(lens), draft)
        gens = [[torch.Generator().manual_seed(1000 * seed + r) for r in range(R)] for _ in range(2)]
        want = rejection_sample(tokens, torch.tensor(lens), draft, dense, gens[0])
        got = rejection_sample_rows(tokens, torch.tensor(lens), block.rows(list(range(R)), K, V),
                                    _OneRowOff(logits, SETTINGS, [n + 1 for n in lens]), gens[1])
        differs += not torch.equal(got.output_tokens, want.output_tokens)
    assert differs >= 15
