"""`dspark bench speed`: single-request decoding speed of Hugging Face and our engine, side by side.

This module times the methods and summarises the calls into rows; the settings and methods are in
``speed_methods.py``, the Markdown report in ``speed_report.py``, the command line in ``cli.py``.

One process loads the target twice (our decoder, and transformers'
``AutoModelForCausalLM`` from the same folder) and every drafter, then decodes
the same prompts (``--per-set`` from each evaluation set, first turn through the
chat template) at batch size 1, greedy and at temperature 1.0 (seeded), with
each method in turn. Methods are interleaved per prompt (their order rotates
from prompt to prompt) so that machine noise falls on all of them alike, and
each method runs once on a short warm-up before anything is timed.

Methods (rows):
  hf-generate         transformers ``generate`` (plain autoregressive)
  hf-prompt-lookup    ``generate(prompt_lookup_num_tokens=K)``
  hf-assisted         ``generate(assistant_model=<--draft-lm folder>)``, K assistant tokens, constant schedule
  ours-plain          ``SpeculativeGenerator`` with ``NoDrafter``
  ours-prompt-lookup  our prompt lookup drafter
  ours-draft-lm       the --draft-lm folder as an independent draft model
  ours-NAME           each ``--drafter NAME=CHECKPOINT`` (DSpark / DFlash / Eagle3), per ``--block-sizes``

Per row and temperature:
  tokens/s      = sum of new tokens / sum of wall seconds of the generate calls (prefill included)
  x hf, x ours  = tokens/s over hf-generate's, over ours-plain's (same temperature)
  tau           = tokens committed per speculative step, bonus token included (ours only)
  t_draft, t_verify = mean seconds per step in ``drafter.propose`` and in the target's verify forward +
                  rejection sampling (``SpeculativeGenerator.timings``, per step)
  ideal         = tau * t_AR / (t_draft + t_verify), t_AR = ours-plain's mean step time (eq. 1: latency
                  per token is (T_draft + T_verify) / tau; ideal = latency_AR / latency_spec)
  decode x      = the speedup over ours-plain in the decode phase: tokens after the first over the seconds
                  from the first speculative step on (prefill and first token, shared by all, excluded)
  efficiency    = (decode x) / ideal: the share of the ideal that the decode loop realises; below 1 is
                  time outside draft + verify (bookkeeping, committing, Python), a little above 1 is noise
  greedy match  = prompts whose greedy output equals plain decoding's token for token: ours-plain's for our
                  drafting rows, hf-generate's for transformers' rows and for ours-plain
  peak RSS      = the process's resident-set high-water mark (VmHWM) during the row's calls, reset before
                  each call through /proc/self/clear_refs; "+RSS" = that peak minus the RSS just before the
                  call (what the call itself allocated: KV caches, activations). All models stay loaded in
                  the one process, so peak RSS includes every loaded model.

Outputs: ``OUT/speed.json`` (settings, machine, per-call records, rows), ``OUT/speed.md`` and the run's section
of docs/reports/performance.md (``--doc``; one section per ``--out-dir``), both rendered from the JSON
(``--from-json`` re-renders).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dspark.bench.machine import MemoryProbe, machine_info
from dspark.bench.speed_methods import (HF_PLAIN, OURS_PLAIN, BenchPrompt, Method, SpeedConfig, build_methods,
                                        greedy_reference, select_prompts)
from dspark.errors import DSparkError


@dataclass
class CallRecord:
    """One timed generate call of one method on one prompt."""

    method: str
    temperature: float
    dataset: str
    idx: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    peak_rss_kib: int
    extra_rss_kib: int
    steps: int = 0  # ours: speculative steps (prefill not counted)
    committed: int = 0  # ours: tokens committed by those steps (sum of acceptance lengths)
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float | None = None  # ours: wall seconds from the first step on (prefill and first token excluded)
    step_draft_s: list[float] = field(default_factory=list)
    step_verify_s: list[float] = field(default_factory=list)
    verified: int = 0  # ours: tokens the verify passes carried (anchors included)
    matches_reference: bool | None = None  # greedy: equal to greedy_reference(method)'s output
    first_mismatch: int | None = None


# ---------------------------------------------------------------- measuring

def _row_key(m: Method) -> str:
    return m.name if m.block_size is None or m.name in (HF_PLAIN, OURS_PLAIN) else f"{m.name}@k{m.block_size}"


def measure(methods: list[Method], prompts: list[BenchPrompt], cfg: SpeedConfig, probe: MemoryProbe,
            log=print) -> list[CallRecord]:
    """Warm up every method, then time them interleaved per prompt (order rotated per prompt)."""
    records: list[CallRecord] = []
    for temperature in cfg.temperatures:
        for m in methods:  # warm-up: first prompt, a few tokens, not recorded
            m.run(prompts[0].ids, temperature, prompts[0].seed, cfg.warmup_tokens)
        for i, p in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            outputs: dict[str, list[int]] = {}
            line = []
            for m in order:
                before = probe.start()
                t0 = time.perf_counter()
                out, extra = m.run(p.ids, temperature, p.seed, cfg.max_new_tokens)
                seconds = time.perf_counter() - t0
                peak = probe.peak()
                outputs[_row_key(m)] = out
                records.append(CallRecord(_row_key(m), temperature, p.dataset, p.idx, len(p.ids), len(out), seconds,
                                          peak, max(0, peak - before), **extra))
                line.append(f"{_row_key(m)} {len(out) / seconds:.1f}")
            if temperature == 0:
                _compare_greedy(records[-len(order):], outputs)
            log(f"[speed] T={temperature:g} {i + 1}/{len(prompts)} {p.dataset}#{p.idx} tok/s: " + ", ".join(line))
    return records


def _compare_greedy(records: list[CallRecord], outputs: dict[str, list[int]]) -> None:
    for r in records:
        ref = outputs.get(greedy_reference(r.method) or "")
        if ref is None:
            continue
        out = outputs[r.method]
        r.matches_reference = out == ref
        if not r.matches_reference:
            r.first_mismatch = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))


def summarise(records: list[CallRecord], methods: list[Method], temperatures: list[float]) -> list[dict[str, Any]]:
    """One row per (temperature, method): the quantities of the module docstring."""
    rows = []
    for temperature in temperatures:
        by = {_row_key(m): [r for r in records if r.method == _row_key(m) and r.temperature == temperature]
              for m in methods}
        tok_s = {k: sum(r.new_tokens for r in v) / max(sum(r.seconds for r in v), 1e-12) for k, v in by.items() if v}
        plain = by.get(OURS_PLAIN) or []
        plain_steps = sum(r.steps for r in plain)
        t_ar = (sum(r.draft_s + r.verify_s for r in plain) / plain_steps) if plain_steps else None
        plain_decode = _decode_tokens_per_s(plain)
        for m in methods:
            key, calls = _row_key(m), by[_row_key(m)]
            if not calls:
                continue
            row: dict[str, Any] = {
                "temperature": temperature, "method": m.name, "key": key, "family": m.family,
                "block_size": m.block_size, "note": m.note, "prompts": len(calls),
                "new_tokens": sum(r.new_tokens for r in calls), "seconds": sum(r.seconds for r in calls),
                "tokens_per_s": tok_s[key],
                "x_hf_generate": tok_s[key] / tok_s[HF_PLAIN] if HF_PLAIN in tok_s else None,
                "x_ours_plain": tok_s[key] / tok_s[OURS_PLAIN] if OURS_PLAIN in tok_s else None,
                "peak_rss_mib": max(r.peak_rss_kib for r in calls) / 1024,
                "extra_rss_mib": max(r.extra_rss_kib for r in calls) / 1024,
                "drafter_weights_mib": m.weights_mib,
            }
            if m.family == "ours":
                steps = sum(r.steps for r in calls)
                draft = [d for r in calls for d in r.step_draft_s]
                verify = [v for r in calls for v in r.step_verify_s]
                row["steps"] = steps
                row["tau"] = sum(r.committed for r in calls) / steps if steps else None
                row["verified_per_step"] = sum(r.verified for r in calls) / steps if steps else None
                row["draft_ms"] = 1e3 * sum(r.draft_s for r in calls) / steps if steps else None
                row["verify_ms"] = 1e3 * sum(r.verify_s for r in calls) / steps if steps else None
                row["draft_ms_median"] = 1e3 * statistics.median(draft) if draft else None
                row["verify_ms_median"] = 1e3 * statistics.median(verify) if verify else None
                row["decode_tokens_per_s"] = _decode_tokens_per_s(calls)
                if plain_decode and row["decode_tokens_per_s"]:
                    row["x_ours_plain_decode"] = row["decode_tokens_per_s"] / plain_decode
                if t_ar and steps and row.get("x_ours_plain_decode"):
                    step_s = (row["draft_ms"] + row["verify_ms"]) / 1e3
                    row["ideal_speedup"] = row["tau"] * t_ar / step_s  # eq. (1)
                    row["efficiency"] = row["x_ours_plain_decode"] / row["ideal_speedup"]
            if temperature == 0:
                flags = [r.matches_reference for r in calls if r.matches_reference is not None]
                row["greedy_match"] = [sum(flags), len(flags)] if flags else None
                row["mismatches"] = [f"{r.dataset}#{r.idx}@{r.first_mismatch}" for r in calls
                                     if r.matches_reference is False]
            rows.append(row)
    return rows


def _decode_tokens_per_s(calls: list[CallRecord]) -> float | None:
    """Tokens after the first over the time from the first speculative step on (the decode phase)."""
    seconds = sum(r.decode_s or 0.0 for r in calls)
    tokens = sum(max(r.new_tokens - 1, 0) for r in calls if r.decode_s)
    return tokens / seconds if seconds > 0 else None


def run_speed_bench(cfg: SpeedConfig, command: str = "", log=print) -> dict[str, Any]:
    from dspark.target.model import load_target
    from dspark.target.loading import torch_dtype

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    target = load_target(cfg.target, dtype=torch_dtype(cfg.dtype), fuse=True, device=cfg.device, batch_invariant=True)
    if target.tokenizer is None:
        raise DSparkError(f"{cfg.target} has no tokenizer; the speed benchmark encodes text prompts")
    prompts = select_prompts(target, cfg)
    compiled = None
    if cfg.compile:
        from dspark.modeling.compile import compile_decoder

        compiled = load_target(cfg.target, dtype=torch_dtype(cfg.dtype), tokenizer=False, fuse=True,
                               device=cfg.device, batch_invariant=True, pack=False)
        compile_decoder(compiled.model)
        log("[speed] compiled twin of the target: its first (warm-up) calls compile")
    methods = build_methods(target, cfg, log, compiled)
    log(f"[speed] {len(prompts)} prompts x {len(methods)} methods x {len(cfg.temperatures)} temperatures")
    machine = machine_info(cfg.device)  # before measuring: the load average says how busy the machine was
    probe = MemoryProbe()
    records = measure(methods, prompts, cfg, probe, log)
    return {
        "command": command, "config": asdict(cfg), "machine": machine, "started": started,
        "wall_s": time.perf_counter() - t0, "memory_method": probe.method, "num_prompts": len(prompts),
        "prompts": [{"dataset": p.dataset, "idx": p.idx, "tokens": len(p.ids), "seed": p.seed} for p in prompts],
        "rows": summarise(records, methods, cfg.temperatures),
        # per-call records without the per-step time lists (their medians are in the rows)
        "records": [{k: v for k, v in asdict(r).items() if not k.startswith("step_")} for r in records],
    }
