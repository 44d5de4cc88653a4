"""Turn logits into the sampling distribution, identically for target and draft.

Shapes: ``(..., V)`` — any leading dims, V = vocabulary size.

Temperature 0 (or below ``GREEDY_EPS``) means greedy: the distribution is the
one-hot vector of the argmax, so rejection sampling reduces to exact match.
top-k and top-p are applied after temperature, to target and draft alike
(docs/conventions.md §Verification), so the verifier's target distribution is the processed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings. ``seed`` makes a request reproducible."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def make_generator(self) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(self.seed if self.seed is not None else torch.seed() % (2**63))
        return gen


def logits_to_probs(
    logits: torch.Tensor,  # (..., V)
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # (..., V) float32, rows sum to 1
    """Processed sampling distribution for one request's logits (``logits_to_probs_rows`` with one setting)."""
    rows = logits.reshape(-1, logits.shape[-1])
    n = rows.shape[0]
    probs = logits_to_probs_rows(rows, torch.full((n,), float(temperature)), torch.full((n,), int(top_k)),
                                 torch.full((n,), float(top_p)))
    return probs.reshape(logits.shape)


def logits_to_probs_rows(
    logits: torch.Tensor,  # (N, V)
    temperature: torch.Tensor,  # (N,) float; < GREEDY_EPS = greedy
    top_k: torch.Tensor,  # (N,) int; 0 or >= V = off
    top_p: torch.Tensor,  # (N,) float in (0, 1]; 1 = off
) -> torch.Tensor:  # (N, V) float32, rows sum to 1
    """Every row's processed distribution with its own settings, in a few batched operations.

    Each operation works row by row, so a row gets what it would get alone, bit for bit
    (tests/sampling/test_processing.py): greedy rows are the one-hot argmax; the others are scaled by their
    temperature, cut to their top-k (one ``topk`` at the largest k, each row's k-th value read from it),
    soft-maxed and cut to their top-p (one stable sort of the rows that ask for it). Rows with a top-k of at most
    ``TOP_K_SPARSE`` whose k-th logit is not tied with the next one are computed on their k likeliest tokens only
    (``_sparse_top_k``: the same distribution without a pass over the vocabulary per operation).
    """
    logits = logits.float()
    N, V = logits.shape
    dev = logits.device
    temperature, top_k, top_p = temperature.to(dev), top_k.to(dev), top_p.to(dev)
    greedy = temperature < GREEDY_EPS  # (N,)
    probs = torch.empty_like(logits)
    sampled = (~greedy).nonzero().squeeze(-1)  # (S,)
    if len(sampled) < N:
        rows = greedy.nonzero().squeeze(-1)
        probs[rows] = torch.nn.functional.one_hot(logits[rows].argmax(-1), V).float()
    if len(sampled) == 0:
        return probs
    k = top_k[sampled].long()
    sparse = ((k > 0) & (k <= min(TOP_K_SPARSE, V - 1))).nonzero().squeeze(-1)  # rows of `sampled`
    if len(sparse):
        rows = sampled[sparse]
        every = len(rows) == N  # the common case of a sampling batch: no copies of rows
        dist, order, tied = _sparse_top_k(logits if every else logits[rows], temperature[rows].float(), k[sparse],
                                          top_p[rows].float())
        if every and not bool(tied.any()):
            return probs.zero_().scatter_(-1, order, dist)
        done = ~tied
        probs[rows[done]] = torch.zeros(int(done.sum()), V, device=dev).scatter_(-1, order[done], dist[done])
        keep = torch.ones(len(sampled), dtype=torch.bool, device=dev)
        keep[sparse[done]] = False  # the tied rows go the dense way below
        sampled, k = sampled[keep], k[keep]
        if len(sampled) == 0:
            return probs
    scaled = logits[sampled] / temperature[sampled, None].float()  # (S, V)
    cut_k = ((k > 0) & (k < V)).nonzero().squeeze(-1)
    if len(cut_k):
        rows, kk = scaled[cut_k], k[cut_k]
        kth = torch.topk(rows, int(kk.max()), dim=-1).values.gather(-1, (kk - 1)[:, None])  # (C, 1)
        scaled[cut_k] = rows.masked_fill(rows < kth, float("-inf"))
    dist = torch.softmax(scaled, dim=-1)  # (S, V)
    p = top_p[sampled].float()
    cut_p = (p < 1.0).nonzero().squeeze(-1)
    if len(cut_p):
        dist[cut_p] = _top_p(dist[cut_p], p[cut_p])
    probs[sampled] = dist
    return probs


#: rows cut to at most this many tokens by top-k are processed on their TOP_K_SPARSE + 1 likeliest tokens only; the
#: width is fixed, not the batch's largest k, so a row's bits never depend on the other rows' settings
TOP_K_SPARSE = 64


def _sparse_top_k(
    logits: torch.Tensor,  # (C, V) float32
    temperature: torch.Tensor,  # (C,) > 0
    top_k: torch.Tensor,  # (C,) in [1, TOP_K_SPARSE], < V
    top_p: torch.Tensor,  # (C,) in (0, 1]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # probabilities, token ids (C, W), tied rows (C,) bool
    """The dense path's distribution for rows cut to their k likeliest tokens, computed on those k values: one
    ``topk`` of the raw logits (a positive temperature keeps their order), temperature, softmax and top-p over k
    values; W = min(TOP_K_SPARSE + 1, V) whatever the rows' k (the reductions then have one shape, so a row's bits
    do not depend on its neighbours), the probabilities past a row's k are 0. The dense path keeps every token tied
    with the k-th; a row whose k-th and (k+1)-th logits are equal is flagged instead, for the dense path."""
    C, V = logits.shape
    width = min(TOP_K_SPARSE + 1, V)
    values, order = torch.topk(logits, width, dim=-1)  # (C, width) descending
    kth = values.gather(-1, (top_k - 1)[:, None])  # (C, 1)
    tied = (values.gather(-1, top_k[:, None]) == kth).squeeze(-1)  # (C,)
    inside = torch.arange(width, device=logits.device)[None, :] < top_k[:, None]  # (C, width)
    dist = torch.softmax((values / temperature[:, None]).masked_fill(~inside, float("-inf")), dim=-1)  # (C, width)
    cut = top_p < 1.0
    if bool(cut.any()):  # values are sorted: the smallest prefix whose mass reaches top_p (the crossing token stays)
        keep = (dist.cumsum(-1) - dist) < top_p[:, None]
        kept = dist.masked_fill(~keep, 0.0)
        dist = torch.where(cut[:, None], kept / kept.sum(-1, keepdim=True), dist)
    return dist, order, tied


#: top-p looks for its cut among this many likeliest tokens first (a partial sort), and sorts a whole row
#: only when their mass falls short of top_p: a full sort of 49,152 probabilities costs ~4 ms a row on a CPU
TOP_P_CANDIDATES = 1024


def _top_p(
    rows: torch.Tensor,  # (C, V) probabilities
    top_p: torch.Tensor,  # (C,) in (0, 1)
) -> torch.Tensor:  # (C, V) renormalised over the smallest prefix (by probability) whose mass reaches top_p
    """Keep the smallest prefix of the tokens sorted by probability whose mass reaches top_p (the token
    crossing it stays). The prefix and its sums are the same whether read off ``topk`` or a full sort."""
    V = rows.shape[-1]
    k = min(TOP_P_CANDIDATES, V)
    values, order = torch.topk(rows, k, dim=-1)  # (C, k) descending
    cum = values.cumsum(-1)
    full = (cum[:, -1] < top_p).nonzero().squeeze(-1)  # rows whose cut lies beyond the candidates
    if len(full):
        sorted_probs, full_order = torch.sort(rows[full], dim=-1, descending=True, stable=True)
        keep_full = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[full, None]
    keep_sorted = (cum - values) < top_p[:, None]  # (C, k)
    keep = torch.zeros_like(rows, dtype=torch.bool).scatter(-1, order, keep_sorted)
    if len(full):
        keep[full] = torch.zeros_like(keep_full).scatter(-1, full_order, keep_full)
    kept = rows.masked_fill(~keep, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def sample_from_probs(
    probs: torch.Tensor,  # (V,) or (N, V)
    generator: torch.Generator | None,
) -> torch.Tensor:  # () or (N,) int64
    """Inverse-CDF sampling with one uniform per row from ``generator``.

    Uses one uniform per row (not torch.multinomial) so that the random stream
    a request consumes does not depend on the vocabulary layout or batch.
    """
    n = 1 if probs.dim() == 1 else probs.reshape(-1, probs.shape[-1]).shape[0]
    idx = sample_with_uniforms(probs.reshape(-1, probs.shape[-1]), draw_uniforms(generator, n))
    return idx[0] if probs.dim() == 1 else idx


def draw_uniforms(generator: torch.Generator | None, n: int = 1) -> torch.Tensor:  # (n,) on the generator's device
    """``n`` uniforms from a request's generator (None: the global one), drawn on the generator's device (its
    stream; a request's generator is on the CPU): what ``sample_from_probs`` consumes, one per row."""
    return torch.rand(n, generator=generator, device=generator.device if generator is not None else None)


def sample_with_uniforms(
    probs: torch.Tensor,  # (N, V), rows need not be normalised
    uniforms: torch.Tensor,  # (N,) in [0, 1), one per row (each from its request's generator)
) -> torch.Tensor:  # (N,) int64
    """Inverse-CDF sampling of every row with its given uniform: the batched half of ``sample_from_probs``."""
    rows = probs.float()
    cdf = rows.cumsum(-1)  # (N, V)
    u = uniforms.reshape(-1, 1).to(rows.device) * cdf[:, -1:]  # (N, 1)
    idx = torch.searchsorted(cdf, u, right=True).clamp_max(rows.shape[-1] - 1).squeeze(-1)
    # searchsorted may land on a zero-probability slot after float round-off: step back
    bad = rows.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, rows.argmax(-1), idx)
    return idx
