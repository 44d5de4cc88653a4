"""Lossless batched rejection sampling: the verifier of speculative decoding.

Shapes: R = requests in the batch, K = most draft tokens any request proposes
this step, V = vocabulary size.

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), with
the conventions of DeepSpec and vLLM (docs/conventions.md §Verification):

- draft token k of request r, x = draft_tokens[r, k], is **accepted** if
  u_{r,k} < min(1, target_probs[r, k, x] / draft_probs[r, k, x]) and every
  earlier draft of the request was accepted (the leading run counts);
- at the first rejection, at position k, the **recovered** token is sampled
  from norm(max(target_probs[r, k] - draft_probs[r, k], 0)), or from
  target_probs[r, k] when that residual mass is <= ``RESIDUAL_EPS``;
- when all num_draft[r] drafts are accepted, the **bonus** token is sampled
  from target_probs[r, num_draft[r]].

Every emitted token then follows the processed target distribution exactly,
and a one-hot (greedy) target reduces the rule to exact match with its argmax.

Randomness. Each request draws only from its own ``generators[r]``: first
exactly num_draft[r] acceptance uniforms (one per draft, also after a
rejection), then the single uniform that inverse-CDF sampling
(``sample_from_probs``) uses for the recovered or bonus token: one
``torch.rand`` call per request, after which the whole batch is verified and
sampled in tensor operations. So what request r gets, and the state its generator
is left in, do not depend on the other requests of the batch or on K, and a
fixed seed reproduces the output. Several rows may pass the *same* generator
object (handy for large statistical tests): such rows draw from it in row
order, all their acceptance uniforms first, then their recovered/bonus draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.sampling.processing import sample_with_uniforms

#: residual mass at or below which the recovered token falls back to target_probs
RESIDUAL_EPS = 1e-8

PADDING_TOKEN = -1


@dataclass
class RejectionOutput:
    """What verification commits per request."""

    output_tokens: torch.Tensor  # (R, K+1) int64: accepted drafts, then one recovered-or-bonus token; -1 after
    num_accepted: torch.Tensor  # (R,) int64 accepted draft tokens
    num_emitted: torch.Tensor  # (R,) int64 = num_accepted + 1


class Rows(Protocol):
    """Distributions of a batch read only where the sampler reads them: row k of request r holds the distribution
    of its k-th position (targets: K+1 rows per request, drafts: K). ``DenseRows`` reads an (R, J, V) tensor; a
    verify step passes readers that never build one (``dspark.sampling.rows``, ``DraftBlock.rows``)."""

    def at(self, tokens: torch.Tensor) -> torch.Tensor:  # (R, K) int64 -> (R, K) probability of tokens[r, k] at row k
        ...

    def rows(self, index: torch.Tensor) -> torch.Tensor:  # (R,) int64 -> (R, V) the distribution at row index[r]
        ...


@dataclass
class DenseRows:
    """``Rows`` of a whole (R, J, V) tensor of distributions."""

    probs: torch.Tensor  # (R, J, V)

    def at(self, tokens: torch.Tensor) -> torch.Tensor:  # (R, K) -> (R, K), K <= J
        return _probs_at(self.probs[:, : tokens.shape[1]], tokens)

    def rows(self, index: torch.Tensor) -> torch.Tensor:  # (R,) -> (R, V)
        return _select_rows(self.probs, index)


def rejection_sample(
    draft_tokens: torch.Tensor,  # (R, K) int64; entries at k >= num_draft[r] are padding, ignored
    num_draft: torch.Tensor,  # (R,) int64 in 0..K
    draft_probs: torch.Tensor,  # (R, K, V) distributions the drafts were sampled from
    target_probs: torch.Tensor,  # (R, K+1, V) processed target distributions; row num_draft[r] gives the bonus
    generators: list[torch.Generator | None],  # (R,) one per request
) -> RejectionOutput:
    """Verify a batch of draft blocks; see the module docstring for the rule."""
    _check_shapes(draft_tokens, num_draft, draft_probs, target_probs, generators)
    return rejection_sample_rows(draft_tokens, num_draft, DenseRows(draft_probs), DenseRows(target_probs), generators)


def rejection_sample_rows(
    draft_tokens: torch.Tensor,  # (R, K) int64; entries at k >= num_draft[r] are padding, ignored
    num_draft: torch.Tensor,  # (R,) int64 in 0..K
    draft: Rows,  # K rows per request: the distributions the drafts were sampled from
    target: Rows,  # K+1 rows per request: processed target distributions; row num_draft[r] gives the bonus
    generators: list[torch.Generator | None],  # (R,) one per request
) -> RejectionOutput:
    """``rejection_sample`` reading the distributions only where the rule does: each draft's probability under
    both, then one target row (and one draft row) per request, the row its recovered or bonus token comes from.
    The same tokens and generator states as ``rejection_sample`` on the dense tensors these readers read."""
    R, K = draft_tokens.shape
    if tuple(num_draft.shape) != (R,) or len(generators) != R:
        raise ValueError(f"need num_draft (R,) and one generator per request for R = {R}: got "
                         f"{tuple(num_draft.shape)} and {len(generators)} generators")
    if R and (int(num_draft.min()) < 0 or int(num_draft.max()) > K):
        raise ValueError(f"num_draft must lie in 0..K = 0..{K}, got {num_draft.tolist()}")
    device = draft_tokens.device
    num_draft = num_draft.to(device=device, dtype=torch.long)
    groups = _group_rows(generators)

    positions = torch.arange(K, device=device)  # (K,)
    valid = positions[None, :] < num_draft[:, None]  # (R, K)
    tokens = torch.where(valid, draft_tokens, 0)  # (R, K) padding made safe to gather
    target_at = _at_least_float(target.at(tokens)).to(device)  # (R, K)
    draft_at = _at_least_float(draft.at(tokens)).to(device)  # (R, K)

    # u < min(1, target / draft); a draft probability of 0 (never sampled) is a rejection
    uniforms, final_uniforms = _draw_uniforms(valid, groups)  # (R, K), (R,)
    ratio = target_at / draft_at.clamp_min(torch.finfo(draft_at.dtype).tiny)
    accepted = (draft_at > 0) & (uniforms < ratio) & valid  # (R, K)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # (R,) leading run only
    rejected = num_accepted < num_draft  # (R,)

    # the recovered (rejected) or bonus (all accepted) token both come from row num_accepted
    final_probs = _final_distribution(num_accepted, rejected, K, draft, target)  # (R, V)
    final_tokens = sample_with_uniforms(final_probs, final_uniforms).to(device)  # (R,)

    output_tokens = torch.full((R, K + 1), PADDING_TOKEN, dtype=torch.long, device=device)
    output_tokens[:, :K] = torch.where(positions[None, :] < num_accepted[:, None], draft_tokens, PADDING_TOKEN)
    output_tokens.scatter_(1, num_accepted[:, None], final_tokens[:, None])
    return RejectionOutput(output_tokens=output_tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)


def _check_shapes(
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generators: list[torch.Generator | None],
) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be (R, K), got shape {tuple(draft_tokens.shape)}")
    R, K = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (R, K + 1):
        raise ValueError(
            f"target_probs must be (R, K+1, V) = ({R}, {K + 1}, V), got {tuple(target_probs.shape)}"
        )
    V = target_probs.shape[2]
    if tuple(draft_probs.shape) != (R, K, V):
        raise ValueError(f"draft_probs must be (R, K, V) = ({R}, {K}, {V}), got {tuple(draft_probs.shape)}")
    if tuple(num_draft.shape) != (R,):
        raise ValueError(f"num_draft must be (R,) = ({R},), got {tuple(num_draft.shape)}")
    if len(generators) != R:
        raise ValueError(f"need one generator (or None) per request: {R} requests, {len(generators)} generators")
    if R and (int(num_draft.min()) < 0 or int(num_draft.max()) > K):
        raise ValueError(f"num_draft must lie in 0..K = 0..{K}, got {num_draft.tolist()}")
    return R, K


def _probs_at(
    probs: torch.Tensor,  # (R, K, V)
    tokens: torch.Tensor,  # (R, K)
) -> torch.Tensor:  # (R, K) probability of each token
    return probs.gather(-1, tokens[..., None]).squeeze(-1)


def _at_least_float(x: torch.Tensor) -> torch.Tensor:  # float64 stays, anything else becomes float32
    return x if x.dtype == torch.float64 else x.float()


def _group_rows(generators: list[torch.Generator | None]) -> list[tuple[torch.Generator | None, list[int]]]:
    """Rows grouped by generator object (None is one group), groups in first-row order."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    return list(groups.values())


def _draw_uniforms(
    valid: torch.Tensor,  # (R, K) bool, True for real (non-padding) drafts: a prefix of each row
    groups: list[tuple[torch.Generator | None, list[int]]],
) -> tuple[torch.Tensor, torch.Tensor]:  # (R, K) acceptance uniforms (1.0 at padding), (R,) final uniforms
    """Every random number of the step, one generator call per request (per group of rows sharing one).

    A group draws, in this order, the acceptance uniforms of its rows (row-major: num_draft[r] each) and
    then one final uniform per row, the stream the module docstring fixes. On a CPU generator that is one
    ``torch.rand`` call (consecutive calls continue one stream); elsewhere two. The draws are then laid out
    with two index operations, whatever R."""
    R, K = valid.shape
    counts = valid.sum(dim=1).tolist() if K else [0] * R  # num_draft per request
    pieces, acc_rows, acc_cols, fin_rows, acc_at, fin_at = [], [], [], [], [], []
    offset = 0
    for gen, rows in groups:
        n_acc = sum(counts[r] for r in rows)
        device = _device_of(gen)
        if device.type == "cpu":
            pieces.append(torch.rand(n_acc + len(rows), generator=gen))
        else:  # counter-based generators do not continue a stream across calls of other sizes
            pieces += [torch.rand(n_acc, generator=gen, device=device).cpu(),
                       torch.rand(len(rows), generator=gen, device=device).cpu()]
        for r in rows:
            acc_rows += [r] * counts[r]
            acc_cols += range(counts[r])
        acc_at += range(offset, offset + n_acc)
        fin_at += range(offset + n_acc, offset + n_acc + len(rows))
        fin_rows += rows
        offset += n_acc + len(rows)
    flat = torch.cat(pieces)  # (sum num_draft + R,)
    uniforms = torch.ones(R, K)
    if acc_at:
        uniforms[acc_rows, acc_cols] = flat[acc_at]
    final_uniforms = torch.empty(R)
    final_uniforms[fin_rows] = flat[fin_at]
    return uniforms.to(valid.device), final_uniforms


def _final_distribution(
    num_accepted: torch.Tensor,  # (R,)
    rejected: torch.Tensor,  # (R,) bool
    K: int,
    draft: Rows,
    target: Rows,
) -> torch.Tensor:  # (R, V) unnormalised: sample_from_probs scales by the row total
    """Residual norm(max(target - draft, 0)) where rejected, else the target row (bonus)."""
    target_row = _at_least_float(target.rows(num_accepted))  # (R, V)
    if K == 0:
        return target_row
    draft_row = draft.rows(num_accepted.clamp_max(K - 1)).to(target_row)  # (R, V)
    residual = (target_row - draft_row).clamp_min(0.0)  # (R, V)
    # fall back to the target when the residual has (numerically) no mass; also shields
    # all-accepted rows from padding garbage in the draft rows
    use_residual = rejected & (residual.sum(-1) > RESIDUAL_EPS)  # (R,)
    return torch.where(use_residual[:, None], residual, target_row)


def _select_rows(
    probs: torch.Tensor,  # (R, J, V)
    index: torch.Tensor,  # (R,) in 0..J-1
) -> torch.Tensor:  # (R, V) = probs[r, index[r]]
    """Row picking; index_select on a flat view is much faster on CPU than advanced indexing."""
    R, J, V = probs.shape
    try:
        flat = probs.view(R * J, V)
    except RuntimeError:  # e.g. a stride-0 expanded tensor
        return probs.gather(1, index[:, None, None].expand(R, 1, V)).squeeze(1)
    return flat.index_select(0, torch.arange(R, device=index.device) * J + index)


def _device_of(gen: torch.Generator | None) -> torch.device:
    return gen.device if gen is not None else torch.device("cpu")
