"""Profile the whole engine step (``dspark.scheduler.step_cost``): verify passes, drafting and host work.

The verify curve is the SPS table's measurement (``dspark.scheduler.profile.profile_target``); drafting
and host work are timed inside real ``speculative_step`` calls, which is why this lives next to the step
and not in the scheduler (which the step imports).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from dspark.drafters.base import Drafter, NoDrafter, RequestState
from dspark.errors import DSparkError
from dspark.generation.step import prefill, speculative_step
from dspark.modeling.kv_cache import KVCache
from dspark.sampling.processing import SamplingParams
from dspark.scheduler.profile import load_or_profile, model_device, synchronize, profile_target
from dspark.scheduler.sps import SPSTable
from dspark.scheduler.step_cost import CostCurve, StepCostModel
from dspark.target.model import TargetModel


def profile_step_cost(
    target: TargetModel,
    drafter: Drafter | None = None,
    block_size: int | None = None,
    max_requests: int = 16,
    context_len: int = 256,
    repeats: int = 5,
    warmup: int = 1,
    dense: bool = False,
    seed: int = 0,
    verify: SPSTable | None = None,
    profile: dict | None = None,
    requests: list[int] | None = None,
) -> StepCostModel:
    """The whole-step cost model (``dspark.scheduler.step_cost``): verify passes, drafting and host work.

    - verify: ``profile_target`` over R x (gamma + 1) tokens (the SPS table's measurement; ``verify`` reuses
      one already taken);
    - draft and host, for R = 1..``max_requests``: real ``speculative_step`` calls that verify every draft,
      over R requests whose contexts (``context_len`` tokens, a short random segment repeated so that
      prompt lookup finds matches) were prefilled once. A step's drafting time is its ``drafter.propose``
      call; its host time is the step's wall time less drafting and less the target's forward pass (timed
      around ``target.forward``), i.e. sampling, rejection sampling, commits and the loop's bookkeeping, timed
      twice: with sampled requests (temperature 1: ``host``) and with the same requests greedy (``host_greedy``). The
      medians of ``repeats`` steps after ``warmup`` untimed ones; every request is rolled back to its
      context after each step, so each step sees the same state.

    gamma = ``block_size`` (default the drafter's, at least 1). The ``profile`` entries are stored with it.
    ``requests``: the request counts drafting and host work are timed at (default every R up to
    ``max_requests``); the curves hold every count from the first to the last, linear between the timed ones
    (``CostCurve.filled``), as the verify curve does between its timed batch sizes (``profile_target``).
    """
    grid = sorted(set(requests)) if requests else list(range(1, max_requests + 1))
    if grid[0] < 1 or grid[-1] > max_requests:
        raise ValueError(f"requests must lie in [1, {max_requests}], got {grid}")
    drafter = drafter or NoDrafter(target.vocab_size)
    gamma = max(block_size if block_size is not None else drafter.block_size, 1)
    if verify is None:
        verify = profile_target(target, gamma, max_requests, context_len, repeats, warmup,
                                drafter.target_layer_ids, dense, seed)
    device = model_device(target)
    states, caches = _profile_requests(target, drafter, gamma, max_requests, context_len, seed)
    snapshots = [(list(s.tokens), s.context_features) for s in states]
    forward_s = []
    forward = target.forward

    def timed_forward(*args, **kwargs):  # the verify pass inside the step, synchronised
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        synchronize(device)
        forward_s.append(time.perf_counter() - start)
        return out

    sampled = [s.sampling for s in states]
    greedy = [dataclasses.replace(p, temperature=0.0) for p in sampled]
    draft_ms, host_ms, host_greedy_ms = [], [], []
    target.forward = timed_forward
    try:
        for R in grid:
            for kind, host_out in ((sampled, host_ms), (greedy, host_greedy_ms)):
                for state, params in zip(states, kind):
                    state.sampling = params
                drafts, hosts = [], []
                for i in range(warmup + repeats):
                    forward_s.clear()
                    start = time.perf_counter()
                    _, timings = speculative_step(target, drafter, states[:R], caches[:R], None, gamma)
                    synchronize(device)
                    total = time.perf_counter() - start
                    if i >= warmup:
                        drafts.append(timings.draft_s)
                        hosts.append(max(total - timings.draft_s - sum(forward_s), 0.0))
                    for state, cache, (tokens, features) in zip(states[:R], caches[:R], snapshots[:R]):
                        _rewind(state, cache, tokens, features)
                if kind is sampled:
                    draft_ms.append(1000.0 * statistics.median(drafts))
                host_out.append(1000.0 * statistics.median(hosts))
    finally:
        del target.forward  # the instance attribute; the class's method again
        for state, params in zip(states, sampled):
            state.sampling = params
    meta = {"threads": torch.get_num_threads(), "dtype": str(next(target.model.parameters()).dtype).removeprefix(
        "torch."), "device": str(device), "block_size": gamma, "context_len": context_len, "repeats": repeats,
        "target": target.name, "source": "dspark profile"}
    meta.update(profile or {})
    model = StepCostModel.from_sps_table(verify, meta)
    return StepCostModel(model.verify, model.max_batch_tokens, CostCurve(tuple(grid), tuple(draft_ms)).filled(),
                         CostCurve(tuple(grid), tuple(host_ms)).filled(), meta,
                         CostCurve(tuple(grid), tuple(host_greedy_ms)).filled())


def _profile_requests(target: TargetModel, drafter: Drafter, gamma: int, count: int, context_len: int,
                      seed: int) -> tuple[list[RequestState], list[KVCache]]:
    """``count`` prefilled requests of ``context_len`` tokens each, ready for a step of gamma drafts."""
    if context_len < 1 or context_len + gamma + 2 > target.max_context:
        raise ValueError(f"context_len must be in [1, {target.max_context - gamma - 2}] for this model, got {context_len}")
    gen = torch.Generator().manual_seed(seed)
    states, caches = [], []
    for r in range(count):
        segment = torch.randint(3, target.vocab_size, (min(16, context_len),), generator=gen).tolist()
        prompt = (segment * (context_len // len(segment) + 1))[:context_len]
        # room for gamma drafts and a bonus token after the first token; the rollback keeps the budget
        sampling = SamplingParams(temperature=1.0, max_new_tokens=gamma + 2, seed=seed + r)
        states.append(RequestState(f"profile-{r}", context_len, prompt, sampling, sampling.make_generator()))
        caches.append(target.new_cache(context_len + gamma + 2))
    chunk = max(1, 4096 // context_len)
    for start in range(0, count, chunk):
        prefill(target, states[start : start + chunk], caches[start : start + chunk], drafter.target_layer_ids)
    for state in states:  # the anchor (not yet fed to the target) continues the pattern: prompt lookup matches
        segment_len = min(16, context_len)
        state.tokens[-1] = state.tokens[context_len - segment_len]
    return states, caches


def _rewind(state: RequestState, cache: KVCache, tokens: list[int], features: torch.Tensor | None) -> None:
    """Undo one step: the committed tokens, the target's cache, the context features and a draft cache."""
    state.tokens = list(tokens)
    state.context_features = features
    state.finished, state.finish_reason = False, None
    cache.truncate(len(tokens) - 1)
    draft = state.draft_state
    if isinstance(draft, KVCache) and draft.length > len(tokens) - 1:  # DSpark's projected context
        draft.truncate(len(tokens) - 1)


def load_or_profile_cost(
    path: str | Path | None,
    target: TargetModel,
    drafter: Drafter,
    max_requests: int,
    profile_to: str | Path | None = None,
    drafter_name: str | None = None,
    context_len: int = 128,
    repeats: int = 3,
    log=print,
) -> StepCostModel | SPSTable:
    """What ``alg1`` / ``async`` plan on, as `dspark serve` and `dspark bench serve` choose it.

    ``path``: a step-cost model or an SPS table file (both load as a ``StepCostModel``). Else the whole step
    profiled now (a quick profile: ``repeats`` steps at ``context_len``, drafting and host work at 1, 2, 4, ...
    requests and ``max_requests``), saved to ``profile_to`` if given. A drafter that drafts nothing (``--drafter
    none``) gets the quick target-only SPS profile of ``load_or_profile``: it has no drafting to price.
    """
    if path is not None and profile_to is not None:
        raise DSparkError("give a cost table to load (--sps-table) or a file to profile one into "
                          "(--profile-step-cost), not both")
    if path is not None:
        return StepCostModel.load(path)
    block = max(drafter.block_size, 1)
    if profile_to is None and (isinstance(drafter, NoDrafter) or drafter.block_size < 1):
        return load_or_profile(None, target, block, max_requests, drafter.target_layer_ids, context_len, repeats,
                               log)
    context_len = max(1, min(context_len, target.max_context - block - 2))
    grid = sorted({2 ** i for i in range(max_requests.bit_length()) if 2 ** i <= max_requests} | {max_requests})
    log(f"[dspark] profiling the whole step (drafting, verify, host work) of 1..{max_requests} requests x "
        f"{block + 1} tokens at context {context_len}" + (f", into {profile_to}" if profile_to else
                                                          " (save one with `dspark profile --step-cost`)"))
    model = profile_step_cost(target, drafter, block, max_requests, context_len, repeats, warmup=1,
                              profile={"drafter": drafter_name} if drafter_name else None, requests=grid)
    if profile_to is not None:
        model.save(profile_to)
    return model


def policy_inputs(spec: str, target: TargetModel, drafter: Drafter, checkpoint: str | Path | None = None,
                  max_requests: int = 1, repeats: int = 9, log=print) -> tuple:
    """What the verify policy ``spec`` (``dspark.scheduler.adapter.parse_policy``'s forms) plans on for ``drafter``,
    as `dspark demo` and `dspark bench speed` build it: (step cost, STS temperatures), for
    ``make_policy(spec, cost, sts)``, one policy per generator (a policy keeps per-request records). The cost, for
    ``alg1`` / ``async`` only, is the whole step profiled now at 1..``max_requests`` requests (``repeats`` timed
    steps per point: with 3, one slow spell of the machine in one point could move the plan of a whole run); the
    temperatures are ``checkpoint``/sts.json's when the drafter has one, else None."""
    from dspark.scheduler.adapter import parse_policy
    from dspark.scheduler.sts import load_sts_json

    cost = None
    if parse_policy(spec).kind in ("alg1", "async"):
        t0 = time.perf_counter()
        cost = load_or_profile_cost(None, target, drafter, max_requests, repeats=repeats, log=lambda _: None)
        log(f"the step's cost profiled at {max_requests} request(s) for {spec} ({time.perf_counter() - t0:.0f} s)")
    sts_file = Path(checkpoint) / "sts.json" if checkpoint is not None else None
    sts = load_sts_json(sts_file, drafter.block_size) if sts_file is not None and sts_file.is_file() else None
    return cost, sts
