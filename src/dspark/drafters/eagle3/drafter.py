"""Eagle3 drafting inside the speculative loop: a chain of <= gamma autoregressive drafts (docs/interop.md §Eagle3).

Shapes: R = requests, K = drafts this step, V = vocabulary, W = draft vocabulary (V
without one), H = hidden size, n = committed positions fed to the target (len(tokens) - 1).

Per request, ``req.draft_state`` holds the draft's own KV cache over the committed
context: entry j (at RoPE position j) is built from the fused target feature f_j and
the token x_{j+1}, so entries 0..n-1 exist once the loop has appended the features
of every committed position. Each step:

1. catch up: run the new entries (causal, cached); the output at entry n-1 (feature
   f_{n-1}, token = the anchor) is the hidden state of the first draft;
2. draft 1 ~ logits_to_probs(lm_head(norm(h))); draft s+1 comes from one more layer
   pass on (embed(draft s), the previous output hidden) at position n-1+s, whose
   key is appended to the cache;
3. roll the cache back to n entries: the chain's entries depend on drafts.

The caches are slots of the model's ``KVPool`` (``Eagle3Model.new_cache``), so every pass
attends all its requests in one call per layer; each position is drawn for all requests
at once (``DraftSampler``): greedy rows take the argmax and leave their ``draft_probs`` 0
(verification compares their tokens), sampled rows keep the distribution they were drawn
from. A drafter with a draft vocabulary samples among its W tokens; the block's ``draft_probs``
are over them (``DraftBlock.vocab``), which rejection sampling reads as 0 elsewhere. Loaded
for decoding on the CPU (``load_eagle3_drafter``) its linear layers are prepacked for oneDNN.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.drafters.draft_sampler import DraftSampler
from dspark.drafters.draft_vocab import load_draft_vocab
from dspark.drafters.eagle3.model import Eagle3Model
from dspark.drafters.options import DraftingOptions
from dspark.modeling.kv_cache import KVCache
from dspark.modeling.packed import pack_all_linears


class Eagle3Drafter:
    def __init__(self, model: Eagle3Model, block_size: int | None = None,
                 draft_vocab: list[int] | None = None) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        if draft_vocab is not None:  # draft only these token ids (--draft-vocab): the model restricted to them
            model = model.restricted(draft_vocab)
        self.model = model  # not switched to eval/frozen: a trainer may wrap its live model (no dropout here)
        self.block_size = block_size or model.config.block_size
        self.target_layer_ids = model.target_layer_ids
        self.vocab_size = model.spec.vocab_size
        self.draft_vocab = model.draft_vocab  # (W,) token ids the drafter may propose, None = all V

    def _cache(self, req: RequestState) -> tuple[KVCache, int]:
        """The request's draft cache (a slot of the model's pool), and how many context entries it has."""
        feats = req.context_features
        if feats is None:
            raise RuntimeError(
                f"request {req.request_id} has no context_features; the loop must capture "
                f"target layers {self.target_layer_ids} for an Eagle3 drafter"
            )
        n = len(req.tokens) - 1
        if feats.shape[0] != n:
            raise RuntimeError(f"request {req.request_id}: {feats.shape[0]} context features for {n} fed tokens")
        cache = req.draft_state
        if not isinstance(cache, KVCache) or cache.slot is None:
            cache = self.model.new_cache(n + req.sampling.max_new_tokens + self.block_size + 2)
            req.draft_state = cache
        if cache.length >= n:  # nothing new (or stale state): recompute the last entry to get its output
            cache.truncate(max(n - 1, 0))
        return cache, n

    @torch.inference_mode()
    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        m = self.model
        R, dev = len(requests), self.model.fc.weight.device
        want = [max(0, min(int(t), self.block_size)) for t in max_tokens]
        K = max(want, default=0)
        tokens = torch.zeros(R, K, dtype=torch.long, device=dev)
        draft_probs = torch.zeros(R, K, m.draft_size, device=dev)  # (R, K, V or W)
        num_tokens = torch.tensor(want, dtype=torch.long, device=dev)
        if K == 0:
            return DraftBlock(tokens, num_tokens, draft_probs, vocab=self.draft_vocab)
        active = [r for r in range(R) if want[r] > 0]  # (A,) the requests that draft position k
        caches, lens, ids, feats = [], [], [], []
        for r in active:
            req = requests[r]
            cache, n = self._cache(req)
            start = cache.length
            caches.append(cache)
            lens.append(n - start)
            ids.append(torch.tensor(req.tokens[start + 1 : n + 1], dtype=torch.long, device=dev))  # x_{j+1}
            feats.append(req.context_features[start:n])  # f_j
        out = m.cached_forward(torch.cat(ids), m.fuse(torch.cat(feats)), lens, caches)  # (N, H)
        hidden = out[torch.tensor(lens, device=dev).cumsum(0) - 1]  # (A, H) output at entry n-1 of each request
        sampler = DraftSampler(requests)

        for k in range(K):
            if k > 0:  # one more layer pass for the requests that draft position k, on their draft k-1
                keep = [i for i, r in enumerate(active) if want[r] > k]
                if not keep:
                    break
                if len(keep) < len(active):
                    active, caches = [active[i] for i in keep], [caches[i] for i in keep]
                    hidden = hidden[keep]
                hidden = m.cached_forward(tokens[active, k - 1], hidden, [1] * len(active), caches)  # (A, H)
            w, sampled, probs = sampler.draw(m.logits(hidden), active)  # (A,), (S,) rows of active, (S, W)
            tokens[active, k] = m.draft_tokens(w)
            if sampled:
                draft_probs[[active[i] for i in sampled], k] = probs  # greedy rows stay 0 (DraftBlock)
        for r in range(R):  # drop the chain's entries: keep the committed context only
            if want[r] > 0:
                requests[r].draft_state.truncate(len(requests[r].tokens) - 1)
        return DraftBlock(tokens, num_tokens, draft_probs, vocab=self.draft_vocab)


def load_eagle3_drafter(path: str | Path, target, block_size: int | None = None,
                        draft_vocab: list[int] | None = None, pack: bool = True) -> Eagle3Drafter:
    """Load an Eagle3 checkpoint (DeepSpec layout) as a drafter for ``target``; block_size None = checkpoint's,
    ``draft_vocab``: draft only those token ids (a full-vocabulary checkpoint restricted in memory). A drafter for
    decoding: on the CPU its linear layers are prepacked for oneDNN (``pack_all_linears``, as the DSpark drafter's;
    ``pack=False`` keeps them plain), so it is not for training."""
    model = Eagle3Model.from_checkpoint(Path(path), target)
    drafter = Eagle3Drafter(model.to(device=target.device, dtype=target.dtype), block_size, draft_vocab)
    if pack and target.device.type == "cpu":
        pack_all_linears(drafter.model)
    return drafter


def load_with_options(path: Path, target, options: DraftingOptions) -> Eagle3Drafter:
    """``load_eagle3_drafter`` as ``options`` ask (block size, draft vocabulary): the registry's loader."""
    vocab = load_draft_vocab(options.draft_vocab, target.vocab_size) if options.draft_vocab else None
    return load_eagle3_drafter(path, target, options.block_size, vocab)
