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
rejection), then the single uniform that ``sample_from_probs`` uses for the
recovered or bonus token. So what request r gets, and the state its generator
is left in, do not depend on the other requests of the batch or on K, and a
fixed seed reproduces the output. Several rows may pass the *same* generator
object (handy for large statistical tests): such rows draw from it in row
order, all their acceptance uniforms first, then their recovered/bonus draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.sampling.processing import sample_from_probs

#: residual mass at or below which the recovered token falls back to target_probs
RESIDUAL_EPS = 1e-8

PADDING_TOKEN = -1


@dataclass
class RejectionOutput:
    """What verification commits per request."""

    output_tokens: torch.Tensor  # (R, K+1) int64: accepted drafts, then one recovered-or-bonus token; -1 after
    num_accepted: torch.Tensor  # (R,) int64 accepted draft tokens
    num_emitted: torch.Tensor  # (R,) int64 = num_accepted + 1


def rejection_sample(
    draft_tokens: torch.Tensor,  # (R, K) int64; entries at k >= num_draft[r] are padding, ignored
    num_draft: torch.Tensor,  # (R,) int64 in 0..K
    draft_probs: torch.Tensor,  # (R, K, V) distributions the drafts were sampled from
    target_probs: torch.Tensor,  # (R, K+1, V) processed target distributions; row num_draft[r] gives the bonus
    generators: list[torch.Generator | None],  # (R,) one per request
) -> RejectionOutput:
    """Verify a batch of draft blocks; see the module docstring for the rule."""
    R, K = _check_shapes(draft_tokens, num_draft, draft_probs, target_probs, generators)
    device = draft_tokens.device
    num_draft = num_draft.to(device=device, dtype=torch.long)
    groups = _group_rows(generators)

    positions = torch.arange(K, device=device)  # (K,)
    valid = positions[None, :] < num_draft[:, None]  # (R, K)
    tokens = torch.where(valid, draft_tokens, 0)  # (R, K) padding made safe to gather
    target_at = _probs_at(target_probs[:, :K], tokens)  # (R, K)
    draft_at = _probs_at(draft_probs, tokens)  # (R, K)

    # u < min(1, target / draft); a draft probability of 0 (never sampled) is a rejection
    uniforms = _acceptance_uniforms(valid, groups)  # (R, K)
    ratio = target_at / draft_at.clamp_min(torch.finfo(draft_at.dtype).tiny)
    accepted = (draft_at > 0) & (uniforms < ratio) & valid  # (R, K)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # (R,) leading run only
    rejected = num_accepted < num_draft  # (R,)

    # the recovered (rejected) or bonus (all accepted) token both come from row num_accepted
    final_probs = _final_distribution(num_accepted, rejected, draft_probs, target_probs)  # (R, V)
    final_tokens = _sample_rows(final_probs, groups).to(device)  # (R,)

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
) -> torch.Tensor:  # (R, K) probability of each token, at least float32
    picked = probs.gather(-1, tokens[..., None]).squeeze(-1)
    return picked if picked.dtype == torch.float64 else picked.float()


def _group_rows(generators: list[torch.Generator | None]) -> list[tuple[torch.Generator | None, list[int]]]:
    """Rows grouped by generator object (None is one group), groups in first-row order."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    return list(groups.values())


def _acceptance_uniforms(
    valid: torch.Tensor,  # (R, K) bool, True for real (non-padding) drafts
    groups: list[tuple[torch.Generator | None, list[int]]],
) -> torch.Tensor:  # (R, K) float32 on valid.device; 1.0 at padding
    """num_draft[r] uniforms per request from its own generator, in row order."""
    R, K = valid.shape
    uniforms = torch.ones(R, K)
    if K == 0:
        return uniforms.to(valid.device)
    valid_cpu = valid.cpu()
    counts = valid_cpu.sum(dim=1).tolist()  # num_draft per request
    for gen, rows in groups:
        if len(rows) == 1:  # the usual case: one generator per request
            n = counts[rows[0]]
            if n:
                uniforms[rows[0], :n] = torch.rand(n, generator=gen, device=_device_of(gen)).cpu()
            continue
        index = torch.tensor(rows)
        mask = valid_cpu[index]  # (rows, K), row-major = the order a per-request loop draws in
        block = torch.ones(len(rows), K)
        block[mask] = torch.rand(int(mask.sum()), generator=gen, device=_device_of(gen)).cpu()
        uniforms[index] = block
    return uniforms.to(valid.device)


def _final_distribution(
    num_accepted: torch.Tensor,  # (R,)
    rejected: torch.Tensor,  # (R,) bool
    draft_probs: torch.Tensor,  # (R, K, V)
    target_probs: torch.Tensor,  # (R, K+1, V)
) -> torch.Tensor:  # (R, V) unnormalised: sample_from_probs scales by the row total
    """Residual norm(max(target - draft, 0)) where rejected, else the target row (bonus)."""
    K = draft_probs.shape[1]
    target_row = _select_rows(target_probs, num_accepted)  # (R, V)
    target_row = target_row if target_row.dtype == torch.float64 else target_row.float()
    if K == 0:
        return target_row
    draft_row = _select_rows(draft_probs, num_accepted.clamp_max(K - 1)).to(target_row.dtype)  # (R, V)
    residual = (target_row - draft_row).clamp_min(0.0)  # (R, V)
    # fall back to the target when the residual has (numerically) no mass; also shields
    # all-accepted rows from padding garbage in draft_probs
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


def _sample_rows(
    probs: torch.Tensor,  # (R, V)
    groups: list[tuple[torch.Generator | None, list[int]]],
) -> torch.Tensor:  # (R,) int64 on the CPU
    """One token per row with ``sample_from_probs``, each row drawing from its own generator."""
    R = probs.shape[0]
    tokens = torch.empty(R, dtype=torch.long)
    on_device: dict[torch.device, torch.Tensor] = {}  # one copy of probs per generator device
    for gen, rows in groups:
        device = _device_of(gen)
        if device not in on_device:
            on_device[device] = probs.to(device)
        if len(rows) == 1:  # the usual case: one generator per request
            tokens[rows[0]] = sample_from_probs(on_device[device][rows[0] : rows[0] + 1], gen)[0].cpu()
            continue
        index = torch.tensor(rows)
        tokens[index] = sample_from_probs(on_device[device].index_select(0, index.to(device)), gen).cpu()
    return tokens


def _device_of(gen: torch.Generator | None) -> torch.device:
    return gen.device if gen is not None else torch.device("cpu")
