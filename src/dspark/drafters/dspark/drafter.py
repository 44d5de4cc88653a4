"""DSpark / DFlash drafting inside the speculative loop (paper §3.1, eq. 4; docs/conventions.md §Drafting).

Shapes: R = requests, G = trained block size (gamma), K = drafts proposed this
step (<= G), V = vocabulary, W = draft vocabulary (V without one), H = hidden size,
F = target-feature width, n = committed positions fed to the target (context length).

Per request the drafter keeps the projected context keys/values of every draft
layer in ``req.draft_state`` (a ``KVCache``). The context only grows (the loop
appends the target features of each committed position), so each step projects
just the new rows. The block [anchor, mask x (G-1)] runs at positions
start..start+G-1, start = len(req.tokens) - 1 (the anchor's position), and sees
the whole context (positions 0..start-1) with no mask. The sequential head then
samples left to right, eq. (4): draft k comes from
``logits_to_probs(U_k + B_k(x_{k-1}))`` with the request's sampling parameters and
generator; those exact distributions are returned as ``draft_probs``, so the
rejection sampler stays lossless. A greedy request takes the argmax (with a top-M
head, the best of the M candidates' scores) and its ``draft_probs`` rows stay 0:
verification compares its tokens. DFlash (no head) samples every slot from U_k.
A drafter loaded for decoding on the CPU runs in the target's decoding layout
(``DSparkModel.use_cpu_kernels``: fused projections, the fused CPU kernels).

Draft vocabulary: a checkpoint that carries one (``draft_vocab`` in model.safetensors)
drafts from its W tokens; a full-vocabulary model given ``draft_vocab`` ids (``--draft-vocab
FILE``) is restricted to them in memory (``restrict_to_draft_vocab``). Sampling happens over
the W tokens; the reported ``draft_probs`` are those probabilities over the W tokens, with ``DraftBlock.vocab``
naming them (verification reads them over V, 0 outside, for the sampled requests only: ``DraftBlock.rows``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.drafters.draft_sampler import DraftSampler
from dspark.drafters.draft_vocab import load_draft_vocab
from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.dspark.vocab import restrict_to_draft_vocab
from dspark.drafters.options import DraftingOptions
from dspark.errors import IncompatibleModelsError
from dspark.modeling.attention import BatchLayout
from dspark.modeling.kv_cache import KVCache, KVPool
from dspark.modeling.layers import Rope
from dspark.modeling.packed import pack_all_linears


class DSparkDrafter:
    def __init__(self, model: DSparkModel, block_size: int | None = None, head_top_m: int | None = None,
                 draft_vocab: list[int] | None = None) -> None:
        trained = model.config.num_drafts  # the block's slots, less slot 0 for an anchor + k checkpoint
        if block_size is not None and not 1 <= block_size <= trained:
            raise ValueError(
                f"block size {block_size} is not possible with this drafter: it was trained with block_size "
                f"{trained}, so it can propose 1..{trained} tokens per step"
            )
        if head_top_m is not None and head_top_m < 1:
            raise ValueError(f"head_top_m must be >= 1 (or None for the full vocabulary), got {head_top_m}")
        if draft_vocab is not None:
            ids = torch.as_tensor(draft_vocab, dtype=torch.long)
            if model.draft_vocab is None:  # draft only these token ids: the model restricted to them
                model = restrict_to_draft_vocab(model, ids)
            elif not torch.equal(model.draft_vocab.cpu(), ids):
                raise IncompatibleModelsError(
                    f"this DSpark checkpoint carries its own draft vocabulary of {model.draft_size} tokens; "
                    f"the --draft-vocab file ({ids.numel()} tokens) differs: drop --draft-vocab")
        self.model = model  # not switched to eval/frozen: a trainer may wrap its live model (no dropout here)
        # the sequential head drafts among the top M tokens of U_k (None = all W; see DSparkModel.head_step)
        self.head_top_m = head_top_m if model.markov_head is not None else None
        self.draft_vocab = model.draft_vocab  # (W,) token ids the drafter may propose, None = all V
        self.block_size = block_size or trained
        self.target_layer_ids = model.target_layer_ids
        self.vocab_size = model.spec.vocab_size
        self.has_confidence = model.confidence_head is not None

    def _context_caches(self, requests: list[RequestState]) -> list[KVCache]:
        """Each request's projected context, brought up to its ``context_features``: the new positions of every
        request are projected together (one ``project_context`` and one ``context_kv`` per layer for the batch,
        however many requests catch up, as after steps that skipped the drafter) and written in one indexed copy
        per layer."""
        m, caches, pieces, spans = self.model, [], [], []  # spans: (cache, start, n) of each request with new rows
        for req in requests:
            feats = req.context_features
            if feats is None:
                raise RuntimeError(
                    f"request {req.request_id} has no context_features; the loop must capture "
                    f"target layers {self.target_layer_ids} for a DSpark drafter"
                )
            n, cache = feats.shape[0], req.draft_state
            if not isinstance(cache, KVCache) or cache.length > n or cache.pool is not self._pool():
                # first use (or a state that is not ours): a slot of the drafter's pool, room for the block after it
                cap = n + req.sampling.max_new_tokens + m.config.block_size + 2
                cache = self._pool().allocate(cap)
                req.draft_state = cache
            if n > cache.length:
                cache.reserve(n - cache.length)  # may grow the pool: the writes below go to its newest tensors
                pieces.append(feats[cache.length:n])  # (n_new, F)
                spans.append((cache, cache.length, n))
            caches.append(cache)
        if not spans:
            return caches
        dev = pieces[0].device
        context = m.project_context(torch.cat(pieces) if len(pieces) > 1 else pieces[0])  # (N_new, H)
        positions = torch.cat([torch.arange(start, n, device=dev) for _, start, n in spans])  # (N_new,)
        slots = torch.cat([torch.full((n - start,), c.slot, dtype=torch.long, device=dev)
                           for c, start, n in spans])  # (N_new,)
        rope, pool = Rope(positions), self._pool()
        for layer_idx in range(m.spec.num_layers):
            cos_sin = rope.for_layer(m.layers[layer_idx].self_attn, context.dtype)
            k, v = m.context_kv(layer_idx, context, cos_sin)  # (Hkv, N_new, D)
            # pool.keys[layer]: (P, Hkv, C, D); indexed by (slot, :, position) it takes (N_new, Hkv, D)
            pool.keys[layer_idx][slots, :, positions] = k.transpose(0, 1)
            pool.values[layer_idx][slots, :, positions] = v.transpose(0, 1)
        for cache, _, n in spans:
            cache.length = n
        return caches

    def _pool(self) -> KVPool:
        """The pool of every request's projected context, so that all blocks attend in one call per layer."""
        m = self.model
        w = m.fc.weight
        pool = self.__dict__.get("_kv_pool")
        if pool is None or pool.keys.dtype != w.dtype or pool.keys.device != w.device:
            s = m.spec
            pool = KVPool(s.num_layers, s.num_kv_heads, s.head_dim, 1, 256, w.dtype, device=w.device)
            self.__dict__["_kv_pool"] = pool
        return pool

    @torch.inference_mode()
    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        m, G = self.model, self.model.config.block_size
        R, dev = len(requests), self.model.fc.weight.device
        want = [max(0, min(int(t), self.block_size)) for t in max_tokens]
        K = max(want, default=0)
        tokens = torch.zeros(R, K, dtype=torch.long, device=dev)
        vocab = self.draft_vocab
        width = self.vocab_size if vocab is None else vocab.numel()  # V, or W with a draft vocabulary
        draft_probs = torch.zeros(R, K, width, device=dev)  # (R, K, V or W)
        conf_logits = torch.zeros(R, K, device=dev) if self.has_confidence else None
        num_tokens = torch.tensor(want, dtype=torch.long, device=dev)
        if K == 0:
            return DraftBlock(tokens, num_tokens, draft_probs, conf_logits, vocab)

        caches = self._context_caches(requests)
        for req, cache in zip(requests, caches):
            start = len(req.tokens) - 1  # position of the anchor
            if cache.length != start:
                raise RuntimeError(
                    f"request {req.request_id}: {cache.length} context features for an anchor at position {start}"
                )
            cache.reserve(G)  # the block's keys sit after the context in the slot while it attends
        # the block [anchor, mask x (G-1)] at positions start..start+G-1 sees the context and all of itself
        layout = BatchLayout.build([G] * R, caches, dev, causal=False)
        ids = torch.full((R, G), m.config.mask_token_id, dtype=torch.long, device=dev)  # (R, G)
        ids[:, 0] = torch.tensor([req.anchor for req in requests], dtype=torch.long, device=dev)
        x = m.embed(ids.view(-1))  # (R*G, H)
        hidden = m.backbone(x, layout.positions, [], layout).view(R, G, -1)  # (R, G, H)
        hidden = hidden[:, m.config.slot_offset:]  # slot 0 drafts nothing in an anchor + k checkpoint

        prev = torch.tensor([req.anchor for req in requests], dtype=torch.long, device=dev)  # x_{-1} = anchor
        # cand None without a top-M head (DFlash has none: its head_top_m is None): every slot drafts over all W
        base, cand = self._base_logits(hidden[:, :K].reshape(R * K, -1), R, K)  # (R, K, W), (R, K, M) or None
        sampler = DraftSampler(requests)
        greedy = sampler.greedy
        state, prevs = None, []  # prevs[k]: (R,) x_{k-1} of every request
        for k in range(K):
            prevs.append(prev)
            state, scores = m.head_scores(state, hidden[:, k], prev, base[:, k],
                                          None if cand is None else cand[:, k])  # (R, M) or (R, W)
            act = [r for r in range(R) if k < want[r]]  # the requests that draft position k
            w = torch.empty(len(act), dtype=torch.long, device=dev)  # (A,) their draft indices
            # greedy rows: the first best index over W, i.e. the one-hot argmax `logits_to_probs_rows` gives them,
            # read off the M candidates' scores without spreading them over W
            g = [i for i, r in enumerate(act) if greedy[r]]
            if g:
                gi = torch.tensor(g, device=dev) if len(g) < len(act) else slice(None)
                gr = torch.tensor([act[i] for i in g], device=dev) if len(g) < R else slice(None)
                w[gi] = _first_best(scores[gr], None if cand is None else cand[gr, k])  # their draft_probs stay 0
            if len(g) < len(act):  # sampled rows: eq. (4) over W, each row with its own settings (row by row: what
                # a call of its own gives); then one uniform per request from its generator, in request order
                si = [i for i, r in enumerate(act) if not greedy[r]]
                sr = torch.tensor([act[i] for i in si], device=dev)  # (S,)
                logits = scores[sr] if cand is None else torch.full_like(base[sr, k], float("-inf")).scatter_(
                    -1, cand[sr, k], scores[sr])  # (S, W)
                w[torch.tensor(si, device=dev)], probs = sampler.sample(logits, [act[i] for i in si])  # (S,), (S, W)
                draft_probs[sr, k] = probs.to(draft_probs.dtype)  # the distribution sampled from, over V or W
            rows = slice(None) if len(act) == R else torch.tensor(act, device=dev)  # (A,)
            tok = w if vocab is None else vocab[w]
            tokens[rows, k] = tok
            prev = prev.clone()
            prev[rows] = tok
        if conf_logits is not None:  # eq. (7) for every slot in one call: it reads h_k and x_{k-1} only
            conf = m.confidence_logits(hidden[:, :K].reshape(R * K, -1), torch.stack(prevs, dim=1).view(-1))
            conf_logits = conf.view(R, K) * (torch.arange(K, device=dev)[None, :] < num_tokens[:, None])
        return DraftBlock(tokens, num_tokens, draft_probs, conf_logits, vocab)

    def _base_logits(self, hidden: torch.Tensor, R: int, K: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """U_k of every slot in one 2-D matmul (U does not depend on x_<k; a 3-D input would copy the LM head),
        and the candidate draft indices of the sequential head: (R*K, H) -> (R, K, W), (R, K, M) or None = all W."""
        m, top_m = self.model, self.head_top_m
        base = m.base_logits(hidden).view(R, K, -1)  # (R, K, W)
        return base, (base.topk(min(top_m, base.shape[-1]), dim=-1).indices if top_m else None)


def _first_best(scores: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
    """The argmax over W of rows whose logits are ``scores`` at ``candidates`` and -inf elsewhere: (N, M), (N, M) ->
    (N,) draft indices, the smallest index among tied best scores (as ``argmax`` of the whole row picks)."""
    if candidates is None:  # (N, W): the scores are the whole row
        return scores.argmax(-1)
    best = scores == scores.max(-1, keepdim=True).values  # (N, M)
    return torch.where(best, candidates, torch.iinfo(candidates.dtype).max).min(-1).values


def load_dspark_drafter(path: str | Path, target, block_size: int | None = None,
                        head_top_m: int | None = None, draft_vocab: list[int] | None = None,
                        pack: bool = True) -> DSparkDrafter:
    """Load a DSpark or DFlash checkpoint (DeepSpec layout) as a drafter for ``target``.

    ``block_size`` None = the checkpoint's; smaller values propose fewer tokens per step
    (the trained block still runs in full). ``head_top_m``: see ``DSparkDrafter``. A drafter for decoding: on
    the CPU its projections are fused, its norms run through the fused CPU kernels (``DSparkModel.use_cpu_kernels``)
    and its linear layers are prepacked (``pack_all_linears``; ``pack=False`` keeps all of it plain), so it is not
    for training.
    """
    model = DSparkModel.from_checkpoint(Path(path), target)
    drafter = DSparkDrafter(model.to(device=target.device, dtype=target.dtype), block_size, head_top_m, draft_vocab)
    if pack and target.device.type == "cpu":  # the decoding layout: fused projections and CPU kernels, then
        drafter.model.use_cpu_kernels()  # weights reordered once for oneDNN (dspark.modeling.packed)
        pack_all_linears(drafter.model)
    return drafter


def load_with_options(path: Path, target, options: DraftingOptions) -> DSparkDrafter:
    """``load_dspark_drafter`` as ``options`` ask (block size, head top-M, draft vocabulary): the registry's loader."""
    vocab = load_draft_vocab(options.draft_vocab, target.vocab_size) if options.draft_vocab else None
    return load_dspark_drafter(path, target, options.block_size, options.head_top_m or None, vocab)


def save_dspark_checkpoint(model: DSparkModel, folder: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write ``model`` to ``folder`` as model.safetensors + config.json (DeepSpec layout)."""
    model.save_checkpoint(Path(folder), dtype)
