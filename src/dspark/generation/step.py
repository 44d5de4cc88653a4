"""One speculative cycle for a batch of requests: draft, choose verify lengths, verify, commit.

Both the offline generator (static batch) and the serving engine
(continuous batching) call ``speculative_step``; nothing here knows about
tokenisation or HTTP. Verify lengths come from a ``VerifyPolicy`` through the
one ``ConfidenceAdapter`` (confidence logits + STS temperatures -> confidences
-> ``policy.choose``), whoever runs the step.

Shapes: R = requests, K = most draft tokens verified this step, V = vocabulary,
F = target-feature width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark.drafters.base import DraftBlock, Drafter, RequestState
from dspark.generation.context_features import append_context_features
from dspark.modeling.kv_cache import KVCache
from dspark.sampling.processing import logits_to_probs, sample_from_probs
from dspark.sampling.rejection import DenseRows, rejection_sample_rows
from dspark.sampling.rows import TargetRows
from dspark.scheduler.confidence import ConfidenceAdapter
from dspark.scheduler.policies import VerifyPolicy
from dspark.target.model import TargetModel


@dataclass
class StepOutcome:
    """What one cycle did for one request."""

    proposal_len: int  # draft tokens sent to verification (verify_len l_r)
    num_accepted: int
    new_tokens: list[int]  # committed this cycle (accepted drafts + recovered/bonus), after stop truncation
    acceptance_length: int  # tau of this cycle: accepted + 1, or accepted if an accepted draft was a stop token
    confidence_logits: torch.Tensor | None = None  # (n_proposed,) raw logits, for calibration
    num_proposed: int = 0


@dataclass
class StepTimings:
    draft_s: float = 0.0
    verify_s: float = 0.0
    steps: int = 0
    verified_tokens: int = 0
    prefill_complete: list[bool] | None = None  # per piece of ``speculative_step``'s ``prefill``: prompt complete

    def add(self, other: "StepTimings") -> None:
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.steps += other.steps
        self.verified_tokens += other.verified_tokens


@dataclass
class TargetState:
    """The target-side state of a request, owned by the loop (not the drafter)."""

    cache: KVCache
    stop_ids: set[int] = field(default_factory=set)


def stop_ids_for(target: TargetModel, request: RequestState) -> set[int]:
    return set(target.eos_token_ids) | set(request.sampling.stop_token_ids)


@dataclass
class PrefillPieces:
    """Prompt pieces to feed in a pass: ``counts[r]`` tokens of ``requests[r]`` from its cache's length on."""

    requests: list[RequestState]
    caches: list[KVCache]  # caches[r] holds the first caches[r].length prompt tokens already fed
    counts: list[int]
    starts: list[int] = field(default_factory=list)  # the caches' lengths before the pass (set by ``ids``)

    def ids(self) -> torch.Tensor:  # (sum counts,) int64 on the host
        self.starts = [c.length for c in self.caches]
        return torch.tensor([t for r, s, n in zip(self.requests, self.starts, self.counts)
                             for t in r.tokens[s : s + n]], dtype=torch.long)

    def finish(
        self,
        target: TargetModel,
        last_logits: torch.Tensor,  # (P, V) each piece's last row
        features: torch.Tensor | None,  # (sum counts, F) the pieces' captured features
    ) -> list[bool]:
        """Context features appended; a first token sampled where a prompt completes. Returns, per piece, whether
        its prompt is now complete."""
        complete, offset = [], 0
        for r, req in enumerate(self.requests):
            n = self.counts[r]
            if features is not None:
                if self.starts[r] == 0:
                    req.context_features = None  # a prompt fed from its start: no earlier features
                append_context_features(req, features[offset : offset + n])  # (n, F)
            offset += n
            complete.append(self.starts[r] + n == len(req.tokens))
            if not complete[-1]:
                continue
            s = req.sampling
            first = int(sample_from_probs(logits_to_probs(last_logits[r], s.temperature, s.top_k, s.top_p),
                                          req.generator))
            req.tokens.append(first)
            _check_finished(req, [first], stop_ids_for(target, req))
        return complete


def prefill(
    target: TargetModel,
    requests: list[RequestState],
    caches: list[KVCache],  # caches[r] holds the first caches[r].length prompt tokens already fed
    capture_layers: list[int] | None,
    counts: list[int] | None = None,  # prompt tokens to feed now per request (None: the rest of each prompt)
) -> list[bool]:
    """Feed the prompts (``tokens``) to the target, whole or in pieces; sample a first token where one completes.

    Context features grow with every piece. A prompt fed in pieces (chunked prefill: the serving engine
    interleaves decode steps between them, or feeds the pieces in a decode step's pass: ``speculative_step``'s
    ``prefill``) leaves the same cache, features and first token as one piece fed at once. Returns, per request,
    whether its prompt is now complete (and its first token sampled).
    """
    if counts is None:
        counts = [len(r.tokens) - c.length for r, c in zip(requests, caches)]
    pieces = PrefillPieces(requests, caches, counts)
    out = target.forward(pieces.ids(), counts, caches, capture_layers, logits_for="last", prompt_from=0)
    return pieces.finish(target, out.logits, out.features)


def _check_finished(req: RequestState, new_tokens: list[int], stop_ids: set[int]) -> None:
    if new_tokens and new_tokens[-1] in stop_ids:
        req.finished, req.finish_reason = True, "stop"
    elif req.num_generated >= req.sampling.max_new_tokens:
        req.finished, req.finish_reason = True, "length"


def greedy_verify(
    logits: torch.Tensor,  # (N, V) verify logits, requests concatenated
    seq_lens: list[int],  # (R,) 1 + verify_len per request
    drafted: torch.Tensor | None,  # (R, K) draft tokens (entries past a request's verify_len unused); None if K = 0
) -> tuple[list[int], list[list[int]]]:  # accepted drafts per request, committed tokens per request
    """Verification of greedy requests without distributions: a draft is accepted while it equals the target's
    argmax at its position, and the argmax after the last accepted draft is committed. This is what
    ``rejection_sample`` gives a one-hot target (a draft sampled from its distribution has probability > 0; the
    ratio is then >= 1 where it is the argmax, 0 elsewhere, and the residual of a one-hot row is that row), without
    the (R, K+1, V) tensors; the requests' generators draw nothing (a greedy request never reads them)."""
    best = logits.max(-1).indices.tolist()  # (N,) the first of tied maxima, as argmax; 4x faster on bf16 rows
    accepted, committed, offset = [], [], 0
    for r, n in enumerate(seq_lens):
        row = best[offset : offset + n]
        drafts = drafted[r, : n - 1].tolist() if n > 1 else []
        acc = 0
        while acc < len(drafts) and drafts[acc] == row[acc]:
            acc += 1
        accepted.append(acc)
        committed.append(drafts[:acc] + [row[acc]])
        offset += n
    return accepted, committed


def _token_rows(starts: list[int], requests: list[int]) -> torch.Tensor:  # (M,) the requests' rows of the batch
    return torch.cat([torch.arange(starts[r], starts[r + 1]) for r in requests])


def _verify(
    logits: torch.Tensor,  # (N, V) verify logits, requests concatenated
    requests: list[RequestState],
    seq_lens: list[int],  # (R,) 1 + verify_len per request
    drafted: torch.Tensor | None,  # (R, K) on the host; None if K = 0
    block: DraftBlock | None,  # the step's proposal (None when nothing was proposed)
    V: int,
) -> tuple[list[int], list[list[int]]]:  # accepted drafts, committed tokens (accepted + recovered/bonus) per request
    """Greedy requests by ``greedy_verify``, the others by ``rejection_sample_rows`` over their own rows, reading
    the target's and the drafter's distributions only where the rule does (``TargetRows``, ``DraftBlock.rows``).
    Every row of both and of the sampler is what a call of its own gives, so a request's result does not depend on
    which others share the step."""
    R = len(requests)
    greedy = [r for r in range(R) if requests[r].sampling.greedy]
    accepted: list[int] = [0] * R
    committed: list[list[int]] = [[] for _ in range(R)]
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    if greedy:
        rows = greedy if len(greedy) < R else None
        sub_logits = logits if rows is None else logits[_token_rows(starts, rows)]
        sub_drafted = drafted if rows is None or drafted is None else drafted[rows]
        acc, com = greedy_verify(sub_logits, [seq_lens[r] for r in greedy], sub_drafted)
        for r, a, c in zip(greedy, acc, com):
            accepted[r], committed[r] = a, c
    sampled = [r for r in range(R) if not requests[r].sampling.greedy]
    if not sampled:
        return accepted, committed
    if len(sampled) < R:
        logits = logits[_token_rows(starts, sampled)]
    reqs, lens = [requests[r] for r in sampled], [seq_lens[r] for r in sampled]
    K = max(lens) - 1
    target = TargetRows(logits, [q.sampling for q in reqs], lens)  # S requests' K+1 rows
    dev = logits.device
    if K:
        draft_tokens = block.tokens[sampled, :K].to(dev)  # the sampler runs where the target's logits are
        draft = block.rows(sampled, K, V)
    else:
        draft_tokens = torch.zeros(len(sampled), 0, dtype=torch.long, device=dev)
        draft = DenseRows(torch.zeros(len(sampled), 0, V, device=dev))
    verify_len = torch.tensor([n - 1 for n in lens])
    result = rejection_sample_rows(draft_tokens, verify_len, draft, target, [q.generator for q in reqs])
    for r, out_row, acc in zip(sampled, result.output_tokens.tolist(), result.num_accepted.tolist()):
        accepted[r], committed[r] = acc, out_row[: acc + 1]
    return accepted, committed


def _inner_policy(policy: VerifyPolicy | ConfidenceAdapter | None) -> VerifyPolicy | None:
    """The verify policy itself, out of its confidence adapter."""
    return policy.policy if isinstance(policy, ConfidenceAdapter) else policy


def _draft_gate(policy: VerifyPolicy | ConfidenceAdapter | None):
    """The policy that decides whether a step drafts, and for which requests (``AsyncTopKScheduler.should_draft``,
    ``drafting_requests``), or None. It decides before any draft exists, from past steps, the request count and the
    requests' past acceptance only, so skipping the drafter is lossless."""
    inner = _inner_policy(policy)
    return inner if hasattr(inner, "should_draft") or hasattr(inner, "drafting_requests") else None


def _drafting_requests(gate, requests: list[RequestState]) -> list[bool]:
    """Which requests draft this step: the gate's per-request answer (``AsyncTopKScheduler.drafting_requests``), or
    its one answer for the whole step (``should_draft``, told how many requests never drafted)."""
    if hasattr(gate, "drafting_requests"):
        return gate.drafting_requests(requests)
    return [gate.should_draft(len(requests), sum(r.drafted_steps == 0 for r in requests))] * len(requests)


def _draft_bound(inner: VerifyPolicy | None, num_requests: int, num_drafting: int) -> int | None:
    """The most drafts a request proposes this step by the policy's capacity (``AsyncTopKScheduler.draft_bound``),
    or None: no bound (no such policy, no drafting request, or too few past steps)."""
    if num_drafting == 0 or not hasattr(inner, "draft_bound"):
        return None
    return inner.draft_bound(num_requests, num_drafting)


def _most_verified(policy: VerifyPolicy | ConfidenceAdapter | None) -> int | None:
    """The most drafts ``policy`` ever verifies per request (``FixedLength.max_verify_len``), or None: no bound."""
    return getattr(_inner_policy(policy), "max_verify_len", None)


def speculative_step(
    target: TargetModel,
    drafter: Drafter,
    requests: list[RequestState],  # active, unfinished; tokens[-1] is each anchor
    caches: list[KVCache],  # target caches holding tokens[:-1] of each request
    # None = verify every proposed draft; a bare VerifyPolicy reads plain-sigmoid confidences
    policy: VerifyPolicy | ConfidenceAdapter | None = None,
    draft_cap: int | None = None,
    prefill: PrefillPieces | None = None,
) -> tuple[list[StepOutcome], StepTimings]:
    """Draft, choose verify lengths, verify and commit, for every request of the batch.

    ``prefill``: prompt pieces of requests not yet decoding, fed in the same target pass as the verify rows (their
    rows come after them; the weights are read once for both). Their outcome (context features, first tokens) is
    as ``prefill`` gives it; ``StepTimings.prefill_complete`` says which prompts completed."""
    R = len(requests)
    budget = [r.sampling.max_new_tokens - r.num_generated for r in requests]  # tokens still allowed
    cap = drafter.block_size if draft_cap is None else min(draft_cap, drafter.block_size)
    most = _most_verified(policy)
    if most is not None:  # drafts a policy never verifies are not proposed (fixed:1 drafts one, as MTP-1)
        cap = min(cap, most)
    # drafts never run past max_new_tokens nor past the context: verify writes 1 + drafts positions
    room = [c.max_length - c.length - 1 if c.max_length is not None else cap for c in caches]
    max_tokens = [max(0, min(cap, b - 1, m)) for b, m in zip(budget, room)]
    inner = _inner_policy(policy)
    if R and hasattr(inner, "greedy_share"):  # the planner prices host work by the batch's sampling
        inner.greedy_share = sum(r.sampling.greedy for r in requests) / R
    gate = _draft_gate(policy)
    if gate is not None and max(max_tokens, default=0) > 0:
        # requests left out verify their anchor alone: the planner expects their drafting to cost more than it brings
        max_tokens = [n if d else 0 for n, d in zip(max_tokens, _drafting_requests(gate, requests))]
    bound = _draft_bound(inner, R, sum(n > 0 for n in max_tokens))
    if bound is not None:  # drafts deeper than the capacity reaches are not proposed (lossless: past steps only)
        max_tokens = [min(n, bound) for n in max_tokens]
    for req, n in zip(requests, max_tokens):
        req.drafted_steps += n > 0

    t0 = time.perf_counter()
    drafting = [r for r, n in enumerate(max_tokens) if n > 0]
    if drafting and len(drafting) == R:
        block = drafter.propose(requests, max_tokens)
    elif drafting:  # only these requests draft: the drafter runs on them alone
        block = drafter.propose([requests[r] for r in drafting], [max_tokens[r] for r in drafting]).spread(drafting, R)
    else:
        block = None
    t1 = time.perf_counter()

    if block is None:
        verify_len = torch.zeros(R, dtype=torch.long)
    elif policy is None:
        verify_len = block.num_tokens.clone()
    else:
        verify_len = torch.minimum(ConfidenceAdapter.of(policy).verify_len(block).to(block.num_tokens.device),
                                   block.num_tokens)
    vl = verify_len.tolist()
    K = max(vl, default=0)

    # verify: [anchor, d_1..d_l] per request, flattened on the host (target.forward moves it to the device)
    seq_lens = [1 + n for n in vl]
    drafted = block.tokens[:, :K].cpu() if K else None  # (R, K), one copy from a GPU drafter
    rows = []
    for r, req in enumerate(requests):
        rows.append(torch.tensor([req.anchor], dtype=torch.long))
        if vl[r]:
            rows.append(drafted[r, : vl[r]])
    ids, lens, all_caches, logits_for = torch.cat(rows), seq_lens, caches, "all"
    N = len(ids)
    if prefill is not None and prefill.requests:
        ids = torch.cat([ids, prefill.ids()])
        lens, all_caches = seq_lens + prefill.counts, caches + prefill.caches
        ends = torch.tensor(prefill.counts).cumsum(0) - 1 + N  # (P,) each piece's last row
        logits_for = torch.cat([torch.arange(N), ends])
    out = target.forward(ids, lens, all_caches, drafter.target_layer_ids, logits_for=logits_for, prompt_from=R)
    complete = None
    if prefill is not None and prefill.requests:
        complete = prefill.finish(target, out.logits[N:], None if out.features is None else out.features[N:])

    accepted_all, emitted_all = _verify(out.logits[:N], requests, seq_lens, drafted, block, target.vocab_size)
    t2 = time.perf_counter()

    outcomes: list[StepOutcome] = []
    offset = 0
    for r, req in enumerate(requests):
        acc = accepted_all[r]
        emitted = emitted_all[r]
        stop_ids = stop_ids_for(target, req)
        tau = acc + 1
        for i, tok in enumerate(emitted[:acc]):  # a stop token inside the accepted drafts ends the request, no bonus
            if tok in stop_ids:
                emitted, tau = emitted[: i + 1], i + 1
                acc_counted = i + 1  # drafts after the stop token do not count as accepted
                break
        else:
            acc_counted = acc
        emitted = emitted[: budget[r]]
        # the cache keeps the anchor and the accepted drafts; the new anchor is emitted[-1]
        caches[r].truncate(caches[r].length - seq_lens[r] + 1 + acc)
        if out.features is not None:
            append_context_features(req, out.features[offset : offset + 1 + acc])  # (1 + acc, F)
        offset += seq_lens[r]
        req.tokens.extend(emitted)
        _check_finished(req, emitted, stop_ids)
        conf = None
        n_prop = int(block.num_tokens[r]) if block is not None else 0
        if block is not None and block.confidence_logits is not None:
            conf = block.confidence_logits[r, :n_prop]
        outcomes.append(StepOutcome(vl[r], acc_counted, emitted, tau, conf, n_prop))
        if max_tokens[r] > 0:
            req.drafted_tokens += tau
    timings = StepTimings(draft_s=t1 - t0, verify_s=t2 - t1, steps=1, verified_tokens=sum(seq_lens),
                          prefill_complete=complete)
    if gate is not None and hasattr(gate, "observe_step") and complete is None:  # prompt pieces would blur the rate
        gate.observe_step(R, block is not None, sum(o.acceptance_length for o in outcomes),
                          time.perf_counter() - t0, sum(n > 0 for n in max_tokens))
    return outcomes, timings
