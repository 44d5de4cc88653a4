"""Speculative generation for a static batch of prompts (offline use, `dspark generate`, eval).

The loop: prefill every prompt, then repeat ``speculative_step`` until every
request has stopped (stop token or max_new_tokens). Requests leave the batch
as they finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.drafters.base import Drafter, NoDrafter, RequestState
from dspark.generation.stats import AcceptanceStats
from dspark.generation.step import StepTimings, prefill, speculative_step
from dspark.sampling.processing import SamplingParams
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import VerifyPolicy
from dspark.target.model import TargetModel


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens, stop token included if one ended the request
    finish_reason: str
    stats: AcceptanceStats
    # per step, for calibration: (confidence logits (n_proposed,), num_accepted)
    confidence_records: list[tuple[torch.Tensor, int]] = field(default_factory=list)


class SpeculativeGenerator:
    def __init__(self, target: TargetModel, drafter: Drafter | None = None,
                 policy: VerifyPolicy | ConfidenceAdapter | None = None, draft_cap: int | None = None) -> None:
        self.target = target
        self.drafter = drafter or NoDrafter(target.vocab_size)
        self.policy = policy  # None = verify every proposed draft
        self.draft_cap = draft_cap
        self.timings = StepTimings()

    def generate(
        self, prompts: list[list[int]], sampling: list[SamplingParams] | SamplingParams,
        request_ids: list[str] | None = None, collect_confidences: bool = False,
    ) -> list[GenerationResult]:
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError("give one SamplingParams per prompt, or one for all")
        request_ids = request_ids or [str(i) for i in range(len(prompts))]
        for p, s in zip(prompts, sampling):
            self.target.check_prompt(p, s.max_new_tokens)
        block = max(self.drafter.block_size, 0)
        requests = [
            RequestState(rid, len(p), list(p), s, s.make_generator())
            for rid, p, s in zip(request_ids, prompts, sampling)
        ]
        caches = [self.target.new_cache(len(p) + s.max_new_tokens + block + 2) for p, s in zip(prompts, sampling)]
        stats = {r.request_id: AcceptanceStats(block_size=max(block, 1)) for r in requests}
        records: dict[str, list] = {r.request_id: [] for r in requests}
        prefill(self.target, requests, caches, self.drafter.target_layer_ids)
        active = [i for i, r in enumerate(requests) if not r.finished]
        while active:
            batch = [requests[i] for i in active]
            outcomes, t = speculative_step(
                self.target, self.drafter, batch, [caches[i] for i in active], self.policy, self.draft_cap
            )
            self.timings.add(t)
            for req, o in zip(batch, outcomes):
                stats[req.request_id].add_step(o.proposal_len, o.num_accepted, o.acceptance_length)
                if collect_confidences and o.confidence_logits is not None:
                    records[req.request_id].append((o.confidence_logits, o.num_accepted))
            active = [i for i in active if not requests[i].finished]
        return [
            GenerationResult(r.request_id, r.tokens[: r.prompt_len], r.tokens[r.prompt_len :],
                             r.finish_reason or "length", stats[r.request_id], records[r.request_id])
            for r in requests
        ]
