"""Tests for the lossless rejection sampler (dspark.sampling.rejection).

Shapes: R requests, K draft slots, V vocabulary.

Statistical setting ("chain"): position k has a fixed target distribution
target[k] (k = 0..K) and a fixed draft distribution draft[k] (k < K); every row
draws its drafts independently, x_k ~ draft[k]. Speculative sampling is then
a sequence of independent single-step trials, so for every position j:

- among rows that reached j (drafts 0..j-1 accepted, i.e. num_accepted >= j),
  the token emitted at j follows target[j] exactly. Conditioning on reaching j
  is harmless: that event depends only on the draws of positions < j, which are
  independent of the draws at j (fresh draft, fresh uniform, fresh final draw);
- the acceptance rate at j among those rows is sum_v min(target[j], draft[j]);
- the pair (token j-1, token j) over rows that reached j follows
  norm(min(target[j-1], draft[j-1])) x target[j] (the accepted-draft law times
  an independent target draw), which also catches correlations between positions.

Checks use explicit bounds (tests/sampling/stats.py): chi-square p >= 1e-6, a
distribution-free total-variation bound, and zero draws on zero-probability
tokens. Negative controls run the same checks on two broken samplers
(accept-every-draft, recover-from-target-instead-of-residual) and require them
to fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark.sampling.processing import logits_to_probs, sample_from_probs
from dspark.sampling.rejection import RESIDUAL_EPS, RejectionOutput, rejection_sample

from .stats import goodness_of_fit

# two-sided normal z for the acceptance-rate check (p ~ 1.2e-7)
ACCEPT_RATE_Z = 5.3


# --------------------------------------------------------------------------- reference


def rejection_sample_reference(
    draft_tokens: torch.Tensor,  # (R, K)
    num_draft: torch.Tensor,  # (R,)
    draft_probs: torch.Tensor,  # (R, K, V)
    target_probs: torch.Tensor,  # (R, K+1, V)
    generators: list[torch.Generator | None],
) -> RejectionOutput:
    """Slow, obviously-correct loop over requests and positions.

    Random-stream contract (documented in rejection.py): each request draws exactly
    num_draft[r] acceptance uniforms, then one uniform via sample_from_probs.
    """
    R, K = draft_tokens.shape
    output_tokens = torch.full((R, K + 1), -1, dtype=torch.long)
    num_accepted = torch.zeros(R, dtype=torch.long)
    for r in range(R):
        gen = generators[r]
        n = int(num_draft[r])
        uniforms = [torch.rand((), generator=gen) for _ in range(n)]
        final_probs = None
        for k in range(n):
            x = int(draft_tokens[r, k])
            target_at = _at_least_float32(target_probs[r, k, x])
            draft_at = _at_least_float32(draft_probs[r, k, x])
            if draft_at > 0 and uniforms[k] < target_at / draft_at:
                output_tokens[r, k] = x
                num_accepted[r] += 1
                continue
            target_row = _at_least_float32(target_probs[r, k])
            residual = (target_row - _at_least_float32(draft_probs[r, k])).clamp_min(0.0)
            final_probs = residual if residual.sum() > RESIDUAL_EPS else target_row
            break
        if final_probs is None:  # every draft accepted: bonus token
            final_probs = _at_least_float32(target_probs[r, n])
        output_tokens[r, int(num_accepted[r])] = sample_from_probs(final_probs, gen)
    return RejectionOutput(output_tokens=output_tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


# --------------------------------------------------------------------------- builders


def random_distributions(
    n: int, V: int, gen: torch.Generator, *, sharpness: float, zero_frac: float, dtype=torch.float32
) -> torch.Tensor:  # (n, V) rows sum to 1, about zero_frac of entries exactly 0 (never a whole row)
    """Dirichlet-like: softmax of scaled Gaussian logits, some tokens zeroed."""
    probs = torch.softmax(torch.randn(n, V, generator=gen, dtype=torch.float64) * sharpness, dim=-1)
    zero = torch.rand(n, V, generator=gen, dtype=torch.float64) < zero_frac
    zero[torch.arange(n), probs.argmax(-1)] = False
    probs = probs.masked_fill(zero, 0.0)
    return (probs / probs.sum(-1, keepdim=True)).to(dtype)


def random_batch(R: int, K: int, V: int, seed: int, *, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Rows with num_draft in 0..K, drafts sampled from draft_probs, garbage in the padding."""
    gen = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, K + 1, (R,), generator=gen)
    target_probs = random_distributions(R * (K + 1), V, gen, sharpness=2.0, zero_frac=0.3, dtype=dtype)
    draft_probs = random_distributions(R * K, V, gen, sharpness=1.0, zero_frac=0.2, dtype=dtype)
    target_probs, draft_probs = target_probs.view(R, K + 1, V), draft_probs.view(R, K, V)
    draft_tokens = torch.multinomial(draft_probs.view(-1, V).float(), 1, generator=gen).view(R, K)
    # padding: tokens, draft rows and target rows beyond what a row uses hold garbage
    positions = torch.arange(K)
    pad = positions[None, :] >= num_draft[:, None]  # (R, K)
    draft_tokens = draft_tokens.masked_fill(pad, -1)
    draft_probs = draft_probs.masked_fill(pad[..., None], float("nan"))
    target_pad = torch.arange(K + 1)[None, :] > num_draft[:, None]  # (R, K+1)
    target_probs = target_probs.masked_fill(target_pad[..., None], float("nan"))
    return dict(draft_tokens=draft_tokens, num_draft=num_draft, draft_probs=draft_probs, target_probs=target_probs)


def seeded_generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def assert_same_output(a: RejectionOutput, b: RejectionOutput) -> None:
    assert torch.equal(a.output_tokens, b.output_tokens)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.num_emitted, b.num_emitted)


# --------------------------------------------------------------------------- statistical losslessness


def chain(K: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position target (K+1, V) and draft (K, V) distributions of varied sharpness.

    Drafts are correlated with the target (so later positions are reached often),
    both have zeroed tokens, so drafts often propose tokens of target prob 0.
    """
    gen = torch.Generator().manual_seed(seed)
    sharpness = [0.5, 1.0, 2.0, 4.0]
    target_logits = torch.stack(
        [torch.randn(V, generator=gen, dtype=torch.float64) * sharpness[k % 4] for k in range(K + 1)]
    )
    draft_logits = 0.7 * target_logits[:K] + torch.randn(K, V, generator=gen, dtype=torch.float64)
    target = _zero_some(torch.softmax(target_logits, -1), 0.25, gen)
    draft = _zero_some(torch.softmax(draft_logits, -1), 0.15, gen)
    return target.float(), draft.float()


def _zero_some(probs: torch.Tensor, frac: float, gen: torch.Generator) -> torch.Tensor:
    zero = torch.rand(probs.shape, generator=gen, dtype=torch.float64) < frac
    zero[torch.arange(probs.shape[0]), probs.argmax(-1)] = False
    probs = probs.masked_fill(zero, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def run_chain(sampler, K: int, V: int, R: int, seed: int, num_draft: torch.Tensor | None = None):
    """Sample R rows of the chain; returns (output, target (K+1, V), draft (K, V))."""
    target, draft = chain(K, V, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    draft_tokens = torch.stack([torch.multinomial(draft[k], R, replacement=True, generator=gen) for k in range(K)], 1)
    if num_draft is None:
        num_draft = torch.full((R,), K, dtype=torch.long)
    out = sampler(
        draft_tokens.view(R, K),
        num_draft,
        draft[None].expand(R, K, V),  # stride-0 views: no (R, K, V) copies
        target[None].expand(R, K + 1, V),
        [gen] * R,  # one shared generator keeps R = 100k fast
    )
    return out, target, draft


def chain_failures(
    out: RejectionOutput, target: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor | None = None
) -> list[str]:
    """Every violated check, as readable strings (empty list = lossless as far as we can tell)."""
    K, V = draft.shape
    tokens, num_accepted = out.output_tokens, out.num_accepted
    if num_draft is None:
        num_draft = torch.full_like(num_accepted, K)
    failures = []
    for j in range(K + 1):
        reached = num_accepted >= j  # rows that emitted a token at position j
        if not bool(reached.any()):
            failures.append(f"position {j}: never reached")
            continue
        fit = goodness_of_fit(tokens[reached, j], target[j])
        if not fit.passes:
            failures.append(f"position {j}: {fit}")
        verified = reached & (num_draft > j)  # rows where draft j was checked (not a bonus slot)
        if bool(verified.any()):
            n = int(verified.sum())
            acc_rate = float((num_accepted[verified] > j).double().mean())
            alpha = float(torch.minimum(target[j], draft[j]).double().sum())
            bound = ACCEPT_RATE_Z * math.sqrt(alpha * (1 - alpha) / n) + 1e-9
            if abs(acc_rate - alpha) > bound:
                failures.append(f"position {j}: acceptance {acc_rate:.4f} vs expected {alpha:.4f} (bound {bound:.4f})")
        if j >= 1:
            accepted_law = torch.minimum(target[j - 1], draft[j - 1]).double()
            pair_law = torch.outer(accepted_law / accepted_law.sum(), target[j].double()).flatten()
            pair_fit = goodness_of_fit(tokens[reached, j - 1] * V + tokens[reached, j], pair_law)
            if not pair_fit.passes:
                failures.append(f"pair ({j - 1}, {j}): {pair_fit}")
    return failures


# (block size K, vocab V): 100,000 sampled blocks each
CHAIN_CONFIGS = [(1, 32), (2, 8), (3, 32), (4, 16), (5, 32), (6, 5), (7, 32)]


@pytest.mark.parametrize("K,V", CHAIN_CONFIGS)
def test_lossless_per_position(K, V):
    out, target, draft = run_chain(rejection_sample, K, V, R=100_000, seed=1000 + K)
    assert out.output_tokens.shape == (100_000, K + 1)
    assert chain_failures(out, target, draft) == []


def test_lossless_with_mixed_verify_lengths():
    """num_draft drawn per row in 0..K (independently of the tokens): bonus tokens at every position."""
    K, V, R = 7, 32, 100_000
    num_draft = torch.randint(0, K + 1, (R,), generator=torch.Generator().manual_seed(5))
    out, target, draft = run_chain(rejection_sample, K, V, R=R, seed=77, num_draft=num_draft)
    assert bool((out.num_accepted <= num_draft).all())
    assert chain_failures(out, target, draft, num_draft) == []


def accept_every_draft(draft_tokens, num_draft, draft_probs, target_probs, generators) -> RejectionOutput:
    """BROKEN on purpose: commits all drafts and a bonus token."""
    R, K = draft_tokens.shape
    rows = torch.arange(R)
    bonus = sample_from_probs(target_probs[rows, num_draft], generators[0])
    output_tokens = torch.cat([draft_tokens, torch.full((R, 1), -1)], 1)
    output_tokens[rows, num_draft] = bonus
    return RejectionOutput(output_tokens=output_tokens, num_accepted=num_draft.clone(), num_emitted=num_draft + 1)


def recover_from_target(draft_tokens, num_draft, draft_probs, target_probs, generators) -> RejectionOutput:
    """BROKEN on purpose: right acceptance rule, but the recovered token ignores the residual."""
    R, K = draft_tokens.shape
    rows = torch.arange(R)
    gen = generators[0]
    target_at = target_probs[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)
    draft_at = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accepted = torch.rand(R, K, generator=gen) < target_at / draft_at
    num_accepted = accepted.long().cumprod(1).sum(1)
    final = sample_from_probs(target_probs[rows, num_accepted], gen)
    output_tokens = torch.where(torch.arange(K)[None] < num_accepted[:, None], draft_tokens, -1)
    output_tokens = torch.cat([output_tokens, torch.full((R, 1), -1)], 1)
    output_tokens[rows, num_accepted] = final
    return RejectionOutput(output_tokens=output_tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)


@pytest.mark.parametrize("broken", [accept_every_draft, recover_from_target])
def test_negative_control_broken_samplers_fail(broken):
    K, V = 3, 32
    out, target, draft = run_chain(broken, K, V, R=100_000, seed=1000 + K)
    failures = chain_failures(out, target, draft)
    assert failures, "the losslessness check accepted a broken sampler"
    # and the very first position alone already fails clearly on both statistics
    first = goodness_of_fit(out.output_tokens[:, 0], target[0])
    assert first.fails_clearly, first


# --------------------------------------------------------------------------- exact behaviour


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_greedy_reduces_to_exact_match(one_hot_drafts):
    R, K, V = 4000, 7, 6
    gen = torch.Generator().manual_seed(3)
    target_probs = logits_to_probs(torch.randn(R, K + 1, V, generator=gen), temperature=0.0)  # one-hot
    argmax = target_probs.argmax(-1)  # (R, K+1)
    # drafts hit the argmax ~70% of the time, so long accepted runs occur
    random_tokens = torch.randint(0, V, (R, K), generator=gen)
    draft_tokens = torch.where(torch.rand(R, K, generator=gen) < 0.7, argmax[:, :K], random_tokens)
    if one_hot_drafts:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, V).float()
    else:
        draft_probs = random_distributions(R * K, V, gen, sharpness=1.0, zero_frac=0.0).view(R, K, V)
    num_draft = torch.randint(0, K + 1, (R,), generator=gen)

    out = rejection_sample(draft_tokens, num_draft, draft_probs, target_probs, [gen] * R)

    match = (draft_tokens == argmax[:, :K]) & (torch.arange(K)[None] < num_draft[:, None])
    expected_accepted = match.long().cumprod(1).sum(1)
    assert torch.equal(out.num_accepted, expected_accepted)
    rows = torch.arange(R)
    assert torch.equal(out.output_tokens[rows, expected_accepted], argmax[rows, expected_accepted])
    prefix = torch.arange(K)[None] < expected_accepted[:, None]
    assert torch.equal(out.output_tokens[:, :K][prefix], draft_tokens[prefix])
    assert bool((out.output_tokens[:, 1:][torch.arange(K)[None] >= expected_accepted[:, None]] == -1).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_path_matches_reference_exactly(seed, dtype):
    R, K, V = 150, 7, 32
    batch = random_batch(R, K, V, seed, dtype=dtype)
    # a few drafts the drafter gave probability 0 (rejected, may hit the residual fallback)
    rows = (batch["num_draft"] >= 1).nonzero().squeeze(1)[:5]
    batch["draft_probs"][rows, 0] = torch.nn.functional.one_hot(torch.tensor(0), V).to(dtype)
    batch["draft_tokens"][rows, 0] = 1
    seeds = [10_000 * seed + r for r in range(R)]
    fast_gens, ref_gens = seeded_generators(seeds), seeded_generators(seeds)

    fast = rejection_sample(**batch, generators=fast_gens)
    ref = rejection_sample_reference(**batch, generators=ref_gens)

    assert_same_output(fast, ref)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(fast_gens, ref_gens))
    assert 0 < int(fast.num_accepted.sum()) < int(batch["num_draft"].sum())  # both branches exercised


def test_batch_independence():
    """Row r alone (with its own K) gives the same tokens and leaves its generator in the same state."""
    R, K, V = 12, 7, 16
    batch = random_batch(R, K, V, seed=11)
    seeds = list(range(500, 500 + R))
    batch_gens = seeded_generators(seeds)
    together = rejection_sample(**batch, generators=batch_gens)
    for r in range(R):
        n = int(batch["num_draft"][r])
        alone_gen = seeded_generators([seeds[r]])
        alone = rejection_sample(
            batch["draft_tokens"][r : r + 1, :n],
            batch["num_draft"][r : r + 1],
            batch["draft_probs"][r : r + 1, :n],
            batch["target_probs"][r : r + 1, : n + 1],
            alone_gen,
        )
        assert torch.equal(alone.output_tokens[0], together.output_tokens[r, : n + 1])
        assert bool((together.output_tokens[r, n + 1 :] == -1).all())
        assert int(alone.num_accepted[0]) == int(together.num_accepted[r])
        assert torch.equal(alone_gen[0].get_state(), batch_gens[r].get_state())
    # and reversing the batch order changes nothing per request
    order = torch.arange(R).flip(0)
    reversed_out = rejection_sample(
        **{name: t[order] for name, t in batch.items()}, generators=seeded_generators([seeds[i] for i in order])
    )
    assert torch.equal(reversed_out.output_tokens, together.output_tokens[order])


def test_seed_reproducibility():
    batch = random_batch(64, 7, 32, seed=4)
    first = rejection_sample(**batch, generators=seeded_generators(list(range(64))))
    again = rejection_sample(**batch, generators=seeded_generators(list(range(64))))
    other = rejection_sample(**batch, generators=seeded_generators(list(range(100, 164))))
    assert_same_output(first, again)
    assert not torch.equal(first.output_tokens, other.output_tokens)


def test_padding_is_ignored():
    """Garbage (NaN probs, -1 / out-of-range tokens) past num_draft changes nothing."""
    R, K, V = 200, 6, 16
    batch = random_batch(R, K, V, seed=8)
    clean = {name: t.clone() for name, t in batch.items()}
    pad = torch.arange(K)[None] >= batch["num_draft"][:, None]
    clean["draft_tokens"][pad] = 0
    clean["draft_probs"][pad] = 1.0 / V
    clean["target_probs"][torch.arange(K + 1)[None] > batch["num_draft"][:, None]] = 1.0 / V
    dirty = batch  # NaN padding from random_batch
    dirty["draft_tokens"] = dirty["draft_tokens"].masked_fill(pad, 10**9)
    seeds = list(range(R))
    assert_same_output(
        rejection_sample(**dirty, generators=seeded_generators(seeds)),
        rejection_sample(**clean, generators=seeded_generators(seeds)),
    )


def test_no_drafts_samples_the_target():
    """num_draft = 0 (K > 0 with padding, and K = 0): one token from target_probs[r, 0]."""
    R, V = 100_000, 32
    gen = torch.Generator().manual_seed(21)
    target = random_distributions(1, V, gen, sharpness=2.0, zero_frac=0.3)[0]  # (V,)
    garbage_target = random_distributions(1, V, gen, sharpness=2.0, zero_frac=0.3)[0]
    for K in (0, 3):
        target_probs = torch.stack([target] + [garbage_target] * K)[None].expand(R, K + 1, V)
        out = rejection_sample(
            torch.full((R, K), 5, dtype=torch.long),
            torch.zeros(R, dtype=torch.long),
            torch.full((R, K, V), 1.0 / V),
            target_probs,
            [gen] * R,
        )
        assert out.output_tokens.shape == (R, K + 1)
        assert bool((out.num_accepted == 0).all()) and bool((out.num_emitted == 1).all())
        assert bool((out.output_tokens[:, 1:] == -1).all())
        fit = goodness_of_fit(out.output_tokens[:, 0], target)
        assert fit.passes, fit


def test_draft_with_zero_target_prob_is_never_accepted():
    R, V = 1000, 8
    target_probs = torch.full((R, 2, V), 1.0 / (V - 1))
    target_probs[:, 0, 3] = 0.0
    draft_probs = torch.full((R, 1, V), 1.0 / V)
    out = rejection_sample(
        torch.full((R, 1), 3), torch.ones(R, dtype=torch.long), draft_probs, target_probs, [torch.Generator()] * R
    )
    assert bool((out.num_accepted == 0).all())
    assert bool((out.output_tokens[:, 0] != 3).all())


@pytest.mark.parametrize("residual_mass,expected_token", [(1e-9, 3), (1e-6, 5)])
def test_recovered_token_falls_back_to_target_when_residual_vanishes(residual_mass, expected_token):
    """Draft token 5 had draft prob 0 -> rejected; residual = residual_mass at token 5.

    At or below RESIDUAL_EPS the recovered token comes from target_probs (token 3),
    above it from the residual (token 5).
    """
    V = 8
    draft_probs = torch.nn.functional.one_hot(torch.tensor([[3]]), V).float()  # (1, 1, V)
    target_probs = torch.zeros(1, 2, V)
    target_probs[0, :, 3] = 1.0
    target_probs[0, 0, 5] = residual_mass
    for seed in range(20):
        out = rejection_sample(
            torch.tensor([[5]]), torch.tensor([1]), draft_probs, target_probs, [torch.Generator().manual_seed(seed)]
        )
        assert int(out.num_accepted[0]) == 0
        assert out.output_tokens[0].tolist() == [expected_token, -1]


def test_shared_generator_draws_in_row_order():
    """Rows sharing one generator == the same rows each drawing from a generator replaying that stream."""
    R, K, V = 40, 4, 16
    batch = random_batch(R, K, V, seed=9)
    shared = rejection_sample(**batch, generators=[torch.Generator().manual_seed(1)] * R)
    again = rejection_sample(**batch, generators=[torch.Generator().manual_seed(1)] * R)
    assert_same_output(shared, again)
    # the acceptance uniforms of row r are the stream's entries after those of rows < r
    stream = torch.rand(int(batch["num_draft"].sum()), generator=torch.Generator().manual_seed(1))
    offset = 0
    for r in range(R):
        n = int(batch["num_draft"][r])
        uniforms = stream[offset : offset + n]
        offset += n
        x = batch["draft_tokens"][r, :n]
        ratio = batch["target_probs"][r, torch.arange(n), x] / batch["draft_probs"][r, torch.arange(n), x]
        assert int(shared.num_accepted[r]) == int((uniforms < ratio).long().cumprod(0).sum())


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda b: b.update(num_draft=b["num_draft"] + 10), "num_draft must lie in"),
        (lambda b: b.update(target_probs=b["target_probs"][:, :-1]), "target_probs must be"),
        (lambda b: b.update(draft_probs=b["draft_probs"][..., :-1]), "draft_probs must be"),
        (lambda b: b.update(num_draft=b["num_draft"][:-1]), "num_draft must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, message):
    batch = random_batch(4, 3, 8, seed=0)
    change(batch)
    with pytest.raises(ValueError, match=message):
        rejection_sample(**batch, generators=seeded_generators([0, 1, 2, 3]))


def test_generator_count_must_match():
    batch = random_batch(4, 3, 8, seed=0)
    with pytest.raises(ValueError, match="one generator"):
        rejection_sample(**batch, generators=seeded_generators([0, 1]))
