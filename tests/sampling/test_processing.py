"""Tests for logits -> sampling distribution and for the inverse-CDF sampler.

Shapes: N rows, V vocabulary. Statistical checks use the explicit bounds of
tests/sampling/stats.py (chi-square p >= 1e-6, distribution-free TV bound,
no draws on zero-probability tokens), with a negative control.
"""

from __future__ import annotations

import pytest
import torch

from dspark.sampling.processing import GREEDY_EPS, SamplingParams, logits_to_probs, sample_from_probs

from .stats import goodness_of_fit


def distinct_logits(N: int, V: int, seed: int) -> torch.Tensor:  # (N, V), no ties within a row
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(V, generator=gen) for _ in range(N)]).float()
    return ranks * 0.37 + 0.05 * torch.rand(N, V, generator=gen)


# --------------------------------------------------------------------------- logits_to_probs


@pytest.mark.parametrize("temperature", [0.0, GREEDY_EPS / 2])
def test_greedy_is_one_hot_argmax(temperature):
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))  # any leading dims
    probs = logits_to_probs(logits, temperature, top_k=5, top_p=0.5)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits(temperature):
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, temperature)
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1))


def test_input_dtype_is_promoted_to_float32():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    probs = logits_to_probs(logits, 1.0, top_p=0.9)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("k", [1, 3, 17])
def test_top_k_keeps_exactly_k(k):
    logits = distinct_logits(32, 40, seed=k)
    probs = logits_to_probs(logits, temperature=0.8, top_k=k)
    kept = probs > 0
    assert bool((kept.sum(-1) == k).all())
    top = torch.topk(logits, k, -1).indices
    assert bool(kept.gather(-1, top).all())
    # kept tokens keep their relative weights: softmax over the top k only
    expected = torch.softmax((logits / 0.8).masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(probs, expected)


def test_top_k_at_or_above_vocab_is_off():
    logits = distinct_logits(4, 10, seed=3)
    for k in (10, 50):
        torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k=k), torch.softmax(logits, -1))


def smallest_prefix_reaching(probs: torch.Tensor, top_p: float) -> torch.Tensor:  # (V,) bool kept
    """Brute force: sort descending, keep tokens until the kept mass first reaches top_p."""
    order = probs.double().argsort(descending=True)
    kept = torch.zeros(probs.shape[-1], dtype=torch.bool)
    mass = 0.0
    for v in order.tolist():
        kept[v] = True
        mass += float(probs[v])
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.63, 0.9, 0.99])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p):
    logits = distinct_logits(64, 24, seed=int(top_p * 100)) * 0.5
    full = torch.softmax(logits, -1)
    # stay clear of rows where a cumulative mass is within float error of top_p
    cum = full.sort(-1, descending=True).values.cumsum(-1)
    clear = ((cum - top_p).abs() > 1e-4).all(-1)
    assert int(clear.sum()) > 48
    probs = logits_to_probs(logits[clear], 1.0, top_p=top_p)
    for row_probs, row_full in zip(probs, full[clear]):
        expected_kept = smallest_prefix_reaching(row_full, top_p)
        assert torch.equal(row_probs > 0, expected_kept)
        torch.testing.assert_close(row_probs, torch.where(expected_kept, row_full, 0) / row_full[expected_kept].sum())


def test_top_p_always_keeps_the_top_token():
    logits = distinct_logits(16, 12, seed=4)
    probs = logits_to_probs(logits, 1.0, top_p=1e-6)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 12).float())


def test_top_k_then_top_p():
    logits = distinct_logits(32, 30, seed=5)
    probs = logits_to_probs(logits, 1.3, top_k=6, top_p=0.8)
    after_top_k = logits_to_probs(logits, 1.3, top_k=6)
    for row_probs, row_top_k in zip(probs, after_top_k):
        assert torch.equal(row_probs > 0, smallest_prefix_reaching(row_top_k, 0.8))


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.5, 10, 1.0), (0.5, 8, 0.7), (0.0, 0, 1.0)]
)
def test_rows_sum_to_one(temperature, top_k, top_p):
    logits = torch.randn(2, 5, 100, generator=torch.Generator().manual_seed(6)) * 3
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 5))


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0)]
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_seed_makes_generator_reproducible():
    a = SamplingParams(seed=7).make_generator()
    b = SamplingParams(seed=7).make_generator()
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy


# --------------------------------------------------------------------------- sample_from_probs


def sparse_distribution(V: int, seed: int, zero_frac: float) -> torch.Tensor:  # (V,) with zeros, first/last 0
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(V, generator=gen) * 2, -1)
    zero = torch.rand(V, generator=gen) < zero_frac
    zero[0] = zero[-1] = True
    zero[probs.masked_fill(zero, -1).argmax()] = False  # keep at least one token
    probs = probs.masked_fill(zero, 0.0)
    return probs / probs.sum()


def test_sample_never_returns_zero_probability_tokens():
    gen = torch.Generator().manual_seed(10)
    rows = torch.stack([sparse_distribution(64, seed, zero_frac=0.8) for seed in range(200)])  # (200, 64)
    # tiny masses next to zeros, and single-token rows at either end
    rows[0] = 0.0
    rows[0, 1], rows[0, 2] = 1e-30, 1.0
    rows[1] = 0.0
    rows[1, -2] = 1.0
    rows[2] = 0.0
    rows[2, 0] = 1.0
    probs = rows.repeat(500, 1)  # (100_000, 64)
    tokens = sample_from_probs(probs, gen)
    assert tokens.shape == (100_000,) and tokens.dtype == torch.long
    assert bool((probs.gather(-1, tokens[:, None]) > 0).all())
    assert bool((tokens[1::200] == 62).all()) and bool((tokens[2::200] == 0).all())


def test_sample_unnormalised_rows():
    """Rows need not sum to 1 (the rejection sampler passes the raw residual)."""
    probs = torch.tensor([[0.0, 2e-3, 0.0, 6e-3]]).expand(200_000, 4)
    tokens = sample_from_probs(probs, torch.Generator().manual_seed(11))
    fit = goodness_of_fit(tokens, torch.tensor([0.0, 0.25, 0.0, 0.75]))
    assert fit.passes, fit


@pytest.mark.parametrize("V", [2, 7, 32])
def test_sample_matches_distribution(V):
    target = sparse_distribution(V, seed=V, zero_frac=0.3)
    tokens = sample_from_probs(target.expand(100_000, V), torch.Generator().manual_seed(12))
    fit = goodness_of_fit(tokens, target)
    assert fit.passes, fit
    assert fit.tv < 0.0135  # = tv_bound(100_000, 32): the bound is explicit


def test_negative_control_distribution_check_rejects_a_wrong_sampler():
    """The same check on draws from a slightly different distribution (two tokens swapped) must fail."""
    V = 32
    target = sparse_distribution(V, seed=V, zero_frac=0.3)
    order = target.argsort(descending=True)
    wrong = target.clone()
    wrong[order[0]], wrong[order[1]] = target[order[1]], target[order[0]]
    assert 0.5 * float((wrong - target).abs().sum()) < 0.2  # a modest error, not a gross one
    tokens = sample_from_probs(wrong.expand(100_000, V), torch.Generator().manual_seed(12))
    fit = goodness_of_fit(tokens, target)
    assert not fit.passes and fit.fails_clearly, fit


def test_sample_one_row_and_reproducibility():
    probs = sparse_distribution(16, seed=1, zero_frac=0.3)
    token = sample_from_probs(probs, torch.Generator().manual_seed(3))
    assert token.shape == () and float(probs[token]) > 0
    first = sample_from_probs(probs.expand(50, 16), torch.Generator().manual_seed(3))
    again = sample_from_probs(probs.expand(50, 16), torch.Generator().manual_seed(3))
    assert torch.equal(first, again)
    assert int(first[0]) == int(token)  # one uniform per row, in row order


def test_rows_with_their_own_settings_equal_each_row_alone():
    """The batched processing (one call, a setting per row) against the per-request one, bit for bit; the
    settings mix greedy, temperature, top-k, top-p and both, with ties at the top-p boundary."""
    from dspark.sampling.processing import logits_to_probs_rows

    gen = torch.Generator().manual_seed(3)
    V = 300
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.9), (1.3, 20, 0.8), (0.0, 7, 0.5),
                (2.0, V, 1.0), (1.0, 1, 0.3), (0.9, 0, 0.999)]
    logits = torch.randn(len(settings) * 3, V, generator=gen) * 3
    logits[5, :40] = 4.0  # ties straddling top-p's cut
    rows = [s for s in settings for _ in range(3)]
    temperature, top_k, top_p = (torch.tensor([s[i] for s in rows]) for i in range(3))
    batched = logits_to_probs_rows(logits, temperature.float(), top_k.long(), top_p.float())
    for i, (t, k, p) in enumerate(rows):
        assert torch.equal(batched[i], logits_to_probs(logits[i], t, k, p)), (i, rows[i])
    # negative control: the comparison sees a setting applied to the wrong row
    swapped = logits_to_probs_rows(logits, temperature.flip(0).float(), top_k.long(), top_p.float())
    assert not all(torch.equal(swapped[i], logits_to_probs(logits[i], *rows[i])) for i in range(len(rows)))


def _dense_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:  # (V,)
    """Slow reference in float64: temperature, every token at or above the k-th logit, softmax, top-p by a full
    sort (ties kept)."""
    scaled = logits.double() / temperature
    kth = scaled.sort(descending=True).values[top_k - 1]
    dist = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)
    if top_p < 1.0:
        kept = smallest_prefix_reaching(dist, top_p)
        dist = torch.where(kept, dist, 0) / dist[kept].sum()
    return dist


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (20, 0.8), (50, 0.95), (64, 0.6), (256, 0.6)])
def test_small_top_k_rows_give_the_dense_distribution(top_k, top_p):
    """Rows cut to a small top-k are computed on their likeliest tokens only (``_sparse_top_k``), larger ones densely;
    either way the distribution is the reference's, over a vocabulary as large as SmolLM2's."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(top_k)) * 4
    probs = logits_to_probs(logits, 0.7, top_k, top_p)
    for row, row_logits in zip(probs, logits):
        want = _dense_reference(row_logits, 0.7, top_k, top_p)
        cum = want.sort(descending=True).values.cumsum(-1)
        if top_p < 1.0 and bool(((cum - top_p).abs() < 1e-5).any()):
            continue  # a cumulative mass within float error of top_p: either cut is right
        assert torch.equal(row > 0, want > 0)
        torch.testing.assert_close(row.double(), want, atol=1e-6, rtol=1e-5)


def test_a_top_k_cut_inside_a_tie_keeps_every_tied_token():
    """The dense path keeps all tokens tied with the k-th logit; so does a small top-k row (it is sent there)."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    logits[:, 10:14] = 9.0  # four tokens tied for first place
    probs = logits_to_probs(logits, 1.0, top_k=2)
    assert torch.equal((probs > 0).sum(-1), torch.full((3,), 4))
    torch.testing.assert_close(probs[:, 10:14], torch.full((3, 4), 0.25))


def test_a_small_top_k_row_does_not_depend_on_its_neighbours_settings():
    """A seeded request samples the same text alone and under load only if its processed row is bitwise the same
    whatever top-k the other rows ask for (a width set by the batch's largest k broke this in 45 of 1,344 cases)."""
    from dspark.sampling.processing import logits_to_probs_rows

    gen = torch.Generator().manual_seed(5)
    for trial in range(6):
        logits = torch.randn(2, 49152, generator=gen) * 3
        for k in (3, 17, 40):
            alone = logits_to_probs(logits[0], 0.7, k, 0.8)
            for other in (1, 64, 200, 0):
                both = logits_to_probs_rows(logits, torch.tensor([0.7, 1.0]), torch.tensor([k, other]),
                                            torch.tensor([0.8, 0.9]))
                assert torch.equal(both[0], alone), (trial, k, other)
