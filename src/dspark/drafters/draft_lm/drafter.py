"""Classic draft-model speculative decoding: a small causal LM sharing the target's tokenizer.

The drafter keeps its own KV cache per request and syncs it to the committed
tokens before drafting (drafts that were rejected last cycle are rolled back).

Shapes: R = requests, K = draft tokens, V = target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.drafters.base import DraftBlock, RequestState
from dspark.drafters.draft_sampler import DraftSampler
from dspark.drafters.options import DraftingOptions
from dspark.errors import IncompatibleModelsError
from dspark.modeling.decoder import CausalLM
from dspark.modeling.kv_cache import KVCache
from dspark.modeling.spec import spec_from_config
from dspark.modeling.weights import load_state_dict, read_config


@dataclass
class _DraftLMState:
    cache: KVCache
    fed: list[int] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelDrafter:
    target_layer_ids = None

    def __init__(self, model: CausalLM, target_vocab_size: int, block_size: int = 4) -> None:
        self.model = model.eval().requires_grad_(False)
        self.vocab_size = target_vocab_size
        self.block_size = block_size

    def _state(self, req: RequestState) -> _DraftLMState:
        if req.draft_state is None:
            cap = len(req.tokens) + req.sampling.max_new_tokens + self.block_size + 2
            req.draft_state = _DraftLMState(self.model.new_cache(cap))
        return req.draft_state

    @torch.inference_mode()
    def propose(self, requests: list[RequestState], max_tokens: list[int]) -> DraftBlock:
        R, K = len(requests), max(max_tokens, default=0)
        tokens = torch.zeros(R, K, dtype=torch.long)
        probs = torch.zeros(R, K, self.vocab_size)
        # sync each cache to the committed tokens (keep at least the anchor to feed)
        states = [self._state(r) for r in requests]
        feed: list[list[int]] = []
        for req, st in zip(requests, states):
            keep = min(_common_prefix(st.fed, req.tokens), len(req.tokens) - 1)
            st.cache.truncate(keep)
            st.fed = st.fed[:keep]
            feed.append(req.tokens[keep:])
        active = [r for r in range(R) if max_tokens[r] > 0]
        sampler = DraftSampler(requests)
        for k in range(K):
            active = [r for r in active if max_tokens[r] > k]
            if not active:
                break
            seq = [feed[r] for r in active]
            ids = torch.tensor([t for s in seq for t in s], dtype=torch.long, device=self.model.lm_head.weight.device)
            hidden, _ = self.model.model(ids, [len(s) for s in seq], [states[r].cache for r in active])
            ends = torch.tensor([len(s) for s in seq]).cumsum(0) - 1
            logits = self._over_vocabulary(self.model.logits(hidden[ends]))  # (A, V)
            drafted, sampled, dist = sampler.draw(logits, active)  # (A,), sampled rows of active, (S, V)
            tokens[active, k] = drafted.to(tokens.device)
            if sampled:  # greedy rows leave their probs 0 (DraftBlock: verification compares their tokens)
                probs[[active[i] for i in sampled], k] = dist.to(probs.device)
            for i, r in enumerate(active):
                states[r].fed.extend(feed[r])
                feed[r] = [int(drafted[i])]
        return DraftBlock(tokens=tokens, num_tokens=torch.tensor(max_tokens, dtype=torch.long), draft_probs=probs)

    def _over_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:  # (A, V_draft) -> (A, V)
        """The draft model's logits over the target's V tokens: -inf past a smaller head, a larger one cut."""
        V = self.vocab_size
        if logits.shape[-1] < V:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], V - logits.shape[-1]), float("-inf"))], -1)
        return logits[:, :V]


def check_same_tokenizer(draft_tok, target_tok, what: str) -> None:
    if draft_tok is None or target_tok is None:
        return
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise IncompatibleModelsError(
            f"{what} uses a different tokenizer/vocabulary than the target "
            f"({len(draft_tok)} vs {len(target_tok)} tokens); a drafter must share the target's tokenizer"
        )


def load_draft_model(path: str, target, block_size: int = 4, dtype: torch.dtype = torch.float32) -> DraftModelDrafter:
    """Load any HF causal-LM folder as an independent drafter for ``target``."""
    from dspark.target.convert import resolve_model_path
    from dspark.target.model import build_model, load_tokenizer

    folder = resolve_model_path(path)
    spec = spec_from_config(read_config(folder))
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        check_same_tokenizer(load_tokenizer(folder), target.tokenizer, f"draft model {path}")
    elif spec.vocab_size != target.vocab_size:
        raise IncompatibleModelsError(
            f"draft model {path} has vocabulary {spec.vocab_size}, the target {target.vocab_size}"
        )
    model = build_model(spec, load_state_dict(folder), f"draft model {path}", dtype, target.device)
    return DraftModelDrafter(model, target.vocab_size, block_size)


def load_with_options(path: Path, target, options: DraftingOptions) -> DraftModelDrafter:
    """``load_draft_model`` in the target's dtype, ``options.block_size`` drafts per step (default 4): the
    registry's loader."""
    return load_draft_model(str(path), target, options.block_size or 4, target.dtype)
