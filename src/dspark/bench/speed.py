"""`dspark bench speed`: single-request decoding speed of Hugging Face and our engine, side by side.

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
  greedy match  = prompts whose greedy output equals hf-generate's token for token
  peak RSS      = the process's resident-set high-water mark (VmHWM) during the row's calls, reset before
                  each call through /proc/self/clear_refs; "+RSS" = that peak minus the RSS just before the
                  call (what the call itself allocated: KV caches, activations). All models stay loaded in
                  the one process, so peak RSS includes every loaded model.

Outputs: ``OUT/speed.json`` (settings, machine, per-call records, rows), ``OUT/speed.md`` and
``docs/performance.md`` (``--doc``), both rendered from the JSON (``--from-json`` re-renders).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from dspark.errors import DSparkError
from dspark.data.eval_sets import BENCHMARKS, DEFAULT_SEED, DISPLAY_NAMES
from dspark.drafters.options import DraftingOptions, DTYPE_NAMES
from dspark.target.presets import DEFAULT_TARGET

HF_PLAIN, OURS_PLAIN = "hf-generate", "ours-plain"
DEFAULT_OUT = "docs/performance"
DEFAULT_DOC = "docs/performance.md"


@dataclass
class SpeedConfig:
    target: str = DEFAULT_TARGET
    sets: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    per_set: int = 2
    eval_dir: str | None = None
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    seed: int = DEFAULT_SEED  # sample idx of a set decodes with seed + idx (DeepSpec's eval rule)
    max_prompt_tokens: int = 1024  # longer prompts are skipped (the next one of the set is taken)
    draft_lm: str | None = None  # the distilled draft LM folder (hf-assisted, ours-draft-lm)
    draft_lm_block_size: int | None = None  # None: the folder's dspark_draft_lm.block_size, else 4
    drafters: list[list[str]] = field(default_factory=list)  # [NAME, CHECKPOINT] pairs
    block_sizes: list[int] | None = None  # None: each checkpoint's own
    prompt_lookup_tokens: int = 7
    include_hf: bool = True
    warmup_tokens: int = 16
    dtype: str = "float32"  # target, drafters and the HF models
    compile: bool = False  # "+compile" twins of ours-plain and each --drafter row (its last variant), compiled target
    head_top_m: list[int] | None = None  # DSpark rows at each M too (--head-top-m); None: the full head only
    draft_vocab: str | None = None  # DSpark/DFlash rows with this draft vocabulary too (and the last M, if any)


# ---------------------------------------------------------------- machine and memory

def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(), "machine": platform.machine(), "python": sys.version.split()[0],
        "torch": torch.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "cpu_model": _cpu_model(), "memory_gib": _mem_total_gib(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "device": "cpu",
    }
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def _cpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if m:
            return m.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return m.group(1).strip() if m else platform.processor() or None
    except OSError:
        return platform.processor() or None


def _mem_total_gib() -> float | None:
    try:
        kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        return round(kib / 2**20, 1)
    except (OSError, AttributeError):
        return None


class MemoryProbe:
    """Peak RSS per call: VmHWM after resetting it (Linux clear_refs), else the lifetime ru_maxrss."""

    def __init__(self) -> None:
        self.per_call = self._reset()
        self.method = ("VmHWM per call (reset via /proc/self/clear_refs)" if self.per_call
                       else "ru_maxrss (process lifetime high-water mark; not per call)")

    @staticmethod
    def _reset() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _status_kib(field_name: str) -> int | None:
        try:
            m = re.search(rf"^{field_name}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M)
            return int(m.group(1)) if m else None
        except OSError:
            return None

    def start(self) -> int:
        """Reset the high-water mark; returns the RSS (KiB) before the call."""
        if self.per_call:
            self._reset()
        return self._status_kib("VmRSS") or 0

    def peak(self) -> int:
        """High-water RSS (KiB) since ``start``."""
        hwm = self._status_kib("VmHWM") if self.per_call else None
        return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ---------------------------------------------------------------- prompts

@dataclass
class BenchPrompt:
    dataset: str
    idx: int
    ids: list[int]
    seed: int


def select_prompts(target, cfg: SpeedConfig) -> list[BenchPrompt]:
    """The first ``per_set`` prompts of each set (DeepSpec's shuffled selection) that fit the limits."""
    from dspark.data.eval_sets import load_eval_dataset

    prompts: list[BenchPrompt] = []
    for name in cfg.sets:
        taken = 0
        for sample in load_eval_dataset(name, cfg.eval_dir, None, cfg.seed).samples:
            ids = target.encode_chat(sample.prompt) if isinstance(sample.prompt, str) else list(sample.prompt)
            if len(ids) > cfg.max_prompt_tokens or len(ids) + cfg.max_new_tokens > target.max_context:
                continue
            prompts.append(BenchPrompt(name, sample.idx, ids, sample.seed))
            taken += 1
            if taken == cfg.per_set:
                break
        if taken < cfg.per_set:
            raise DSparkError(f"{name}: only {taken} prompts have <= {cfg.max_prompt_tokens} tokens; "
                              "raise --max-prompt-tokens or lower --per-set")
    return prompts


# ---------------------------------------------------------------- methods

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
    matches_reference: bool | None = None  # greedy: equal to hf-generate's (or ours-plain's) output
    first_mismatch: int | None = None


@dataclass
class Method:
    name: str
    family: str  # "hf" | "ours"
    block_size: int | None
    run: Callable[[list[int], float, int, int], tuple[list[int], dict]]  # ids, T, seed, max_new -> output, extra
    weights_mib: float = 0.0  # the drafter's own weights (0 for none / prompt lookup)
    note: str = ""


def _module_mib(module) -> float:
    if module is None:
        return 0.0
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20


class _StepLog:
    """Stands in for ``SpeculativeGenerator.timings``: sums like ``StepTimings`` and keeps every step's times."""

    def __init__(self) -> None:
        self.steps, self.draft_s, self.verify_s, self.verified_tokens = 0, 0.0, 0.0, 0
        self.per_step: list[tuple[float, float]] = []
        self.first_step_start: float | None = None  # perf_counter when the first step began (prefill is over)

    def add(self, other) -> None:  # other: dspark.generation.step.StepTimings
        if self.first_step_start is None:  # called right after the step; its draft + verify came just before
            self.first_step_start = time.perf_counter() - other.draft_s - other.verify_s
        self.steps += other.steps
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.verified_tokens += other.verified_tokens
        self.per_step.append((other.draft_s, other.verify_s))


def ours_method(name: str, target, drafter, note: str = "") -> Method:
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    gen = SpeculativeGenerator(target, drafter)

    def run(ids: list[int], temperature: float, seed: int, max_new: int) -> tuple[list[int], dict]:
        gen.timings = log = _StepLog()
        [res] = gen.generate([ids], SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed))
        end = time.perf_counter()
        return res.output_ids, {
            "decode_s": end - log.first_step_start if log.first_step_start is not None else 0.0,
            "steps": log.steps, "committed": res.stats.sum_acceptance_length, "draft_s": log.draft_s,
            "verify_s": log.verify_s, "step_draft_s": [d for d, _ in log.per_step],
            "step_verify_s": [v for _, v in log.per_step],
        }

    block = getattr(drafter, "block_size", None) or None
    return Method(name, "ours", block, run, _module_mib(getattr(drafter, "model", None)), note)


def hf_method(name: str, model, target, block_size: int | None = None, note: str = "", **generate_kwargs) -> Method:
    import torch

    eos = list(target.eos_token_ids)
    pad = eos[0] if eos else None

    def run(ids: list[int], temperature: float, seed: int, max_new: int) -> tuple[list[int], dict]:
        input_ids = torch.tensor([ids], dtype=torch.long)
        kwargs = dict(max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad,
                      attention_mask=torch.ones_like(input_ids), **generate_kwargs)
        if temperature > 0:  # pure sampling at T, like ours (no top-k / top-p)
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False)
        with torch.inference_mode():
            out = model.generate(input_ids, **kwargs)
        return out[0, len(ids):].tolist(), {}

    assistant = generate_kwargs.get("assistant_model")
    return Method(name, "hf", block_size, run, _module_mib(assistant), note)


def build_methods(target, cfg: SpeedConfig, log=print, compiled_target=None) -> list[Method]:
    """Every row the config asks for, models loaded once. ``compiled_target``: the same target, compiled."""
    from dspark.drafters.base import NoDrafter
    from dspark.drafters.registry import load_drafter
    from dspark.drafters.options import torch_dtype

    dtype = torch_dtype(cfg.dtype)

    methods: list[Method] = []
    draft_lm_k = None
    if cfg.draft_lm:
        from dspark.drafters.draft_lm.model import saved_block_size

        draft_lm_k = cfg.draft_lm_block_size or saved_block_size(cfg.draft_lm) or 4
    if cfg.include_hf:
        from transformers import AutoModelForCausalLM

        if target.path is None:
            raise DSparkError("the HF rows need the target as a model folder; pass --no-hf for a target without one")
        log(f"[speed] loading the HF model from {target.path}")
        hf = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype).eval()
        methods.append(hf_method(HF_PLAIN, hf, target))
        k = cfg.prompt_lookup_tokens
        methods.append(hf_method("hf-prompt-lookup", hf, target, k, f"prompt_lookup_num_tokens={k}",
                                 prompt_lookup_num_tokens=k))
        if cfg.draft_lm:
            assistant = AutoModelForCausalLM.from_pretrained(cfg.draft_lm, dtype=dtype).eval()
            assistant.generation_config.num_assistant_tokens = draft_lm_k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            threshold = assistant.generation_config.assistant_confidence_threshold
            if threshold is None:  # unset: transformers applies its default at generate time
                from transformers import GenerationConfig

                defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})()
                threshold = defaults.get("assistant_confidence_threshold", "transformers' default")
            methods.append(hf_method(
                "hf-assisted", hf, target, draft_lm_k,
                f"num_assistant_tokens={draft_lm_k}, constant schedule, assistant_confidence_threshold={threshold}",
                assistant_model=assistant))
    twins = [(OURS_PLAIN, NoDrafter(target.vocab_size))]  # rows that get a "+compile" twin
    methods.append(ours_method(OURS_PLAIN, target, twins[0][1]))
    methods.append(ours_method("ours-prompt-lookup", target, load_drafter("prompt-lookup", target,
                                                                           cfg.prompt_lookup_tokens)))
    if cfg.draft_lm:
        methods.append(ours_method("ours-draft-lm", target, load_drafter(cfg.draft_lm, target, DraftingOptions(block_size=draft_lm_k))))
    for name, path in cfg.drafters:
        own = load_drafter(path, target)
        sizes = cfg.block_sizes or [own.block_size]
        for k in sizes:
            if k > own.block_size:
                log(f"[speed] skipping {name} at block size {k}: its checkpoint proposes at most {own.block_size}")
                continue
            drafter = own if k == own.block_size else load_drafter(path, target, DraftingOptions(block_size=k))
            methods.append(ours_method(f"ours-{name}", target, drafter))
            last = (f"ours-{name}", drafter)
            for suffix, m, vocab, note in _variants(own, cfg):
                last = (f"ours-{name}{suffix}", load_drafter(path, target, DraftingOptions(block_size=k, head_top_m=m, draft_vocab=vocab)))
                methods.append(ours_method(last[0], target, last[1], note))
            twins.append(last)  # the compiled twin of each drafter row: its cheapest-drafting variant
    if compiled_target is not None:  # drafters read no target weights while drafting: shared with the twin
        methods += [ours_method(f"{name}+compile", compiled_target, drafter) for name, drafter in twins]
    names = [(m.name, m.block_size) for m in methods]
    if len(set(names)) != len(names):
        raise DSparkError("two rows share a name and block size; give each --drafter a distinct NAME")
    return methods


def _variants(drafter, cfg: SpeedConfig) -> list[tuple[str, int | None, str | None, str]]:
    """(row suffix, head_top_m, draft_vocab, note) of the cheaper-drafting rows a drafter gets."""
    if not hasattr(drafter, "draft_vocab"):  # not a DSpark/DFlash drafter
        return []
    has_head = drafter.model.markov_head is not None
    tops = (cfg.head_top_m or []) if has_head else []
    out = [(f"-top{m}", m, None, f"sequential head over the top {m} tokens of U_k (--head-top-m)") for m in tops]
    if cfg.draft_vocab:
        from dspark.drafters.draft_vocab import load_draft_vocab

        n = len(load_draft_vocab(cfg.draft_vocab, drafter.vocab_size))
        m = tops[-1] if tops else None
        out.append(((f"-top{m}" if m else "") + f"-vocab{n}", m, cfg.draft_vocab,
                    f"drafts only the {n} tokens of --draft-vocab" + (f", head over the top {m}" if m else "")))
    return out


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
    ref = outputs.get(HF_PLAIN, outputs.get(OURS_PLAIN))
    if ref is None:
        return
    for r in records:
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


# ---------------------------------------------------------------- reports

def _f(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


# (column title, row -> cell text); the greedy-match column is inserted before the memory columns at T = 0
_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("method", lambda r: r["method"]),
    ("k", lambda r: str(r["block_size"] or "")),
    ("tok/s", lambda r: _f(r["tokens_per_s"], 1)),
    ("× hf-generate", lambda r: _f(r["x_hf_generate"])),
    ("× ours-plain", lambda r: _f(r["x_ours_plain"])),
    ("τ", lambda r: _f(r.get("tau"))),
    ("draft ms/step", lambda r: _f(r.get("draft_ms"), 1)),
    ("verify ms/step", lambda r: _f(r.get("verify_ms"), 1)),
    ("ideal ×", lambda r: _f(r.get("ideal_speedup"))),
    ("decode ×", lambda r: _f(r.get("x_ours_plain_decode"))),
    ("efficiency", lambda r: _f(r.get("efficiency"))),
]
_MEMORY_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("peak RSS MiB", lambda r: _f(r["peak_rss_mib"], 0)),
    ("+RSS MiB", lambda r: _f(r["extra_rss_mib"], 0)),
]


def _greedy_cell(r: dict) -> str:
    gm = r.get("greedy_match")
    return f"{gm[0]}/{gm[1]}" if gm else "–"


def _table(rows: list[dict], temperature: float, reference: str) -> list[str]:
    columns = list(_COLUMNS)
    if temperature == 0:
        columns.append((f"greedy = {reference}", _greedy_cell))
    columns += _MEMORY_COLUMNS
    lines = ["| " + " | ".join(title for title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        if r["temperature"] == temperature:
            lines.append("| " + " | ".join(cell(r) for _, cell in columns) + " |")
    return lines


def _per_set_table(result: dict[str, Any], temperature: float, reference: str) -> list[str]:
    """tok/s of each row over the reference's, per evaluation set (from the per-call records)."""
    records = [r for r in result.get("records", []) if r["temperature"] == temperature]
    sets = list(dict.fromkeys(r["dataset"] for r in records))
    if len(sets) < 2:
        return []
    tok: dict[tuple[str, str], list[float]] = {}
    for r in records:
        acc = tok.setdefault((r["method"], r["dataset"]), [0.0, 0.0])
        acc[0] += r["new_tokens"]
        acc[1] += r["seconds"]
    rate = {k: v[0] / v[1] for k, v in tok.items() if v[1] > 0}
    lines = [f"Per set (× {reference}, tok/s over its tok/s on the same prompts):", "",
             "| method | " + " | ".join(DISPLAY_NAMES.get(s, s) for s in sets) + " |", "|---|" + "---|" * len(sets)]
    for method in dict.fromkeys(r["method"] for r in records):
        cells = [f"{rate[(method, s)] / rate[(reference, s)]:.2f}" if (method, s) in rate and (reference, s) in rate
                 else "–" for s in sets]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines + [""]


FORMULAS = """\
- **tok/s** = Σ new tokens / Σ wall seconds of the `generate` calls (batch size 1, prefill included).
- **× hf-generate**, **× ours-plain**: tok/s over that row's tok/s at the same temperature.
- **τ** (acceptance length) = tokens committed per speculative step, bonus token included (our engine only).
- **draft / verify ms/step**: mean time per step in `drafter.propose`, and in the target's verify forward plus
  rejection sampling (`SpeculativeGenerator.timings`); medians are in the JSON.
- **ideal ×** = τ · t_AR / (t_draft + t_verify), with t_AR = ours-plain's mean step time (one target forward of
  one token). This is eq. (1) of the paper (latency per token L = (T_draft + T_verify) / τ) taken as
  L_AR / L_spec: the speedup the measured acceptance and the measured draft and verify costs imply if nothing
  else took time. Means (not medians) make it exactly the ratio of in-loop time per token.
- **decode ×**: the speedup over ours-plain in the decode phase only: tokens after the first / wall seconds from
  the first speculative step to the end of the call (prefill and the first token, which every method shares,
  excluded; they pull the end-to-end ratios towards 1 on short outputs).
- **efficiency** = decode × / ideal ×: how much of the ideal the decode loop realises. Below 1 is time outside
  draft + verify (bookkeeping, committing tokens, Python overhead); a little above 1 is timing noise.
- **greedy =**: prompts whose greedy output equals the reference's token for token (lossless decoding must
  give 100 %; a mismatch is listed as set#sample@first differing position).
- **peak RSS**: the largest resident-set high-water mark over the row's calls. Method: {memory}.
- **+RSS**: that peak minus the RSS just before the call, i.e. what the call itself allocated (KV caches,
  activations). Every model of the run stays loaded in the one process, so peak RSS includes all of them;
  **drafter MiB** (below) is the drafter's own weights.
"""


BF16_MISMATCH = (
    "In bfloat16 these differences are rounding, not lost losslessness: a verify block of 8 tokens, one decode "
    "token and transformers' kernels multiply with different shapes and round differently, so a near-tied greedy "
    "choice can flip, after which the texts diverge (transformers' own prompt lookup differs from its generate "
    "here too). In float32 every row matches token for token (performance-fp32.md), and the test suite checks "
    "exact greedy equality for every drafter.")


def render_markdown(result: dict[str, Any], title: str = "Decoding speed", raw_json: str | None = None) -> str:
    cfg, mach, rows = result["config"], result["machine"], result["rows"]
    reference = HF_PLAIN if any(r["method"] == HF_PLAIN for r in rows) else OURS_PLAIN
    sets = ", ".join(DISPLAY_NAMES.get(s, s) for s in cfg["sets"])
    lines = [
        f"# {title}", "",
        f"Reproduce: `{result['command']}`" if result.get("command") else "", "",
        f"Target `{cfg['target']}`; {result['num_prompts']} prompt(s) ({cfg['per_set']} from each of {sets}; first "
        f"turn through the chat template), batch size 1, up to {cfg['max_new_tokens']} new tokens, "
        f"{cfg.get('dtype', 'float32')}" + (" (HF rows too)" if cfg.get("dtype", "float32") != "float32" else "")
        + ("; '+compile' rows use a torch.compile'd target" if cfg.get("compile") else "") + ".",
        f"Machine: {mach.get('cpu_model') or mach.get('machine')}, {mach.get('cpu_count')} CPUs, "
        f"{mach.get('memory_gib')} GiB; {mach.get('torch_threads')} torch threads; {mach.get('platform')}; "
        f"Python {mach.get('python')}, torch {mach.get('torch')}, transformers {mach.get('transformers')}"
        + (f"; load average at start {mach['load_average']}" if mach.get("load_average") else "") + ".",
        f"Run at {result.get('started')} and took {_f(result.get('wall_s'), 0)} s."
        + (f" Raw results: `{raw_json}`." if raw_json else ""), "",
    ]
    for temperature in cfg["temperatures"]:
        label = "Greedy (temperature 0)" if temperature == 0 else f"Temperature {temperature:g} (seeded sampling)"
        lines += [f"## {label}", ""] + _table(rows, temperature, reference) + [""]
        lines += _per_set_table(result, temperature, reference)
        bad = [r for r in rows if r["temperature"] == temperature and r.get("mismatches")]
        for r in bad:
            lines.append(f"- {r['method']} differs from {reference} on {', '.join(r['mismatches'])}.")
        if bad:
            lines.append("")
            if cfg.get("dtype", "float32") != "float32" and temperature == 0:
                lines += [BF16_MISMATCH, ""]
    notes = [f"- {r['method']}: {r['note']}" for r in rows if r["note"] and r["temperature"] == cfg["temperatures"][0]]
    weights = [f"{r['method']}{'@k' + str(r['block_size']) if r['block_size'] else ''} {r['drafter_weights_mib']:.0f}"
               for r in rows if r["drafter_weights_mib"] and r["temperature"] == cfg["temperatures"][0]]
    lines += ["## Definitions", "", FORMULAS.format(memory=result.get("memory_method", "")).rstrip(), ""]
    if notes or weights:
        lines += ["## Settings", ""] + notes + ([f"- drafter MiB: {', '.join(weights)}"] if weights else []) + [""]
    if cfg.get("drafters"):
        lines += ["Drafter checkpoints: " + ", ".join(f"`{n}` = `{p}`" for n, p in cfg["drafters"]), ""]
    if cfg.get("draft_lm"):
        lines += [f"Draft LM: `{cfg['draft_lm']}`", ""]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict[str, Any], out_dir: str | Path, doc: str | None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "speed.json", out / "speed.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    text = render_markdown(result)
    paths[1].write_text(text)
    if doc:
        doc_path = Path(doc)
        doc_path.parent.mkdir(parents=True, exist_ok=True)
        doc_path.write_text(render_markdown(result, "Performance: single-request decoding speed", str(paths[0])))
        paths.append(doc_path)
    return paths


def run_speed_bench(cfg: SpeedConfig, command: str = "", log=print) -> dict[str, Any]:
    from dspark.target.model import load_target
    from dspark.drafters.options import torch_dtype

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    target = load_target(cfg.target, dtype=torch_dtype(cfg.dtype), fuse=True)
    if target.tokenizer is None:
        raise DSparkError(f"{cfg.target} has no tokenizer; the speed benchmark encodes text prompts")
    prompts = select_prompts(target, cfg)
    compiled = None
    if cfg.compile:
        from dspark.modeling.compile import compile_decoder

        compiled = load_target(cfg.target, dtype=torch_dtype(cfg.dtype), tokenizer=False, fuse=True)
        compile_decoder(compiled.model)
        log("[speed] compiled twin of the target: its first (warm-up) calls compile")
    methods = build_methods(target, cfg, log, compiled)
    log(f"[speed] {len(prompts)} prompts x {len(methods)} methods x {len(cfg.temperatures)} temperatures")
    machine = machine_info()  # before measuring: the load average says how busy the machine was
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


# ---------------------------------------------------------------- CLI

def _named_path(text: str) -> list[str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"expected NAME=CHECKPOINT (e.g. dspark-markov=runs/x/step_latest), got {text!r}")
    return [name.strip(), path.strip()]


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected block sizes >= 1, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected temperatures >= 0, got {text!r}")
    return values


def add_cli(sub: argparse._SubParsersAction) -> None:
    from dspark.serving.cli import bench_subparsers

    p = bench_subparsers(sub).add_parser(
        "speed", help="single-request tokens/s: HF generate / prompt lookup / assisted vs our engine and drafters",
        description="Decodes the same evaluation prompts at batch size 1, greedy and at temperature 1.0, with HF "
        "transformers (generate, prompt lookup, assisted generation with --draft-lm) and our engine (plain, prompt "
        "lookup, --draft-lm, each --drafter at --block-sizes), interleaved per prompt after a warm-up. Reports "
        "tokens/s, ratios to hf-generate and ours-plain, acceptance length, draft/verify ms per step, the ideal "
        "speedup tau*t_AR/(t_draft+t_verify), efficiency, greedy equality with hf-generate and peak RSS. Writes "
        "OUT/speed.json, OUT/speed.md and docs/performance.md.",
        epilog="example: dspark bench speed --draft-lm runs/smollm2-draft-lm/step_latest "
        "--drafter dspark-markov=runs/smollm2-dspark-markov/step_latest "
        "--drafter dflash=runs/smollm2-dflash/step_latest --drafter eagle3=runs/smollm2-eagle3/step_latest "
        "--block-sizes 7,4",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    p.add_argument("--sets", default="all",
                   help="comma-separated evaluation sets, domains (math, code, chat) or all (default: %(default)s)")
    p.add_argument("--per-set", type=int, default=2, help="prompts per set (default: %(default)s)")
    p.add_argument("--eval-dir", default=None, help="folder of the evaluation JSONL files (default: shared/data/eval)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0], help="comma-separated (default: 0,1)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="sample idx of a set samples with seed + idx (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="skip longer prompts (the next of the set is taken) (default: %(default)s)")
    p.add_argument("--draft-lm", default=None, metavar="FOLDER",
                   help="distilled draft LM (`dspark train --config smollm2-draft-lm`) for hf-assisted and "
                   "ours-draft-lm")
    p.add_argument("--draft-lm-block-size", type=int, default=None,
                   help="draft tokens per step for both draft-LM rows (default: the folder's, else 4)")
    p.add_argument("--drafter", dest="drafters", action="append", type=_named_path, default=[],
                   metavar="NAME=CHECKPOINT", help="a trained DSpark/DFlash/Eagle3 checkpoint (repeatable)")
    p.add_argument("--block-sizes", type=_positive_ints, default=None,
                   help="comma-separated block sizes for every --drafter; larger than a checkpoint's own are skipped "
                   "(default: each checkpoint's own)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=7,
                   help="tokens proposed by prompt lookup, HF's and ours (default: %(default)s)")
    p.add_argument("--no-hf", dest="include_hf", action="store_false", help="skip the transformers rows")
    p.add_argument("--head-top-m", type=_positive_ints, default=None, metavar="M[,M...]",
                   help="also time every DSpark --drafter with its head restricted to the top M base tokens "
                   "(rows '<name>-topM'; see `dspark generate --help`)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="also time every DSpark/DFlash --drafter drafting only this `dspark data vocab` file's "
                   "tokens (with the last --head-top-m, if given)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="dtype of the target, the drafters and the HF models (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="also time ours-plain and every --drafter at each block size (its cheapest variant) with a "
                   "torch.compile'd target (rows named '+compile', measured in the same run)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the warm-up call (default: %(default)s)")
    p.add_argument("--threads", type=int, default=argparse.SUPPRESS,
                   help="torch CPU threads (default: the global --threads, else torch's choice)")
    p.add_argument("--out-dir", default=DEFAULT_OUT, help="(default: %(default)s)")
    p.add_argument("--doc", default=DEFAULT_DOC, help="the Markdown page to write ('' for none) (default: %(default)s)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="re-render speed.md and --doc from an earlier speed.json; measure nothing")
    p.set_defaults(func=_bench_speed)


def _command_line() -> str:
    flags = sys.argv[1:]
    if "speed" in flags and "bench" in flags:  # `dspark [--threads N] bench speed ...`
        flags = flags[: flags.index("bench")] + flags[flags.index("speed") + 1:]
    return " ".join(["dspark", "bench", "speed", *(shlex.quote(a) for a in flags)])


def _bench_speed(args: argparse.Namespace) -> int:
    import torch

    from dspark.data.eval_sets import parse_dataset_names

    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
    else:
        threads = getattr(args, "threads", None)
        if threads is not None:
            if threads < 1:
                raise DSparkError(f"--threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        for name in ("per_set", "max_new_tokens", "prompt_lookup_tokens", "warmup_tokens", "max_prompt_tokens"):
            if getattr(args, name) < 1:
                raise DSparkError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        cfg = SpeedConfig(
            target=args.target, sets=parse_dataset_names(args.sets), per_set=args.per_set, eval_dir=args.eval_dir,
            max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens, draft_lm=args.draft_lm,
            draft_lm_block_size=args.draft_lm_block_size, drafters=args.drafters, block_sizes=args.block_sizes,
            prompt_lookup_tokens=args.prompt_lookup_tokens, include_hf=args.include_hf,
            warmup_tokens=args.warmup_tokens, dtype=args.dtype, compile=args.compile, head_top_m=args.head_top_m,
            draft_vocab=args.draft_vocab,
        )
        result = run_speed_bench(cfg, _command_line(), lambda msg: print(msg, file=sys.stderr, flush=True))
    paths = write_outputs(result, args.out_dir, args.doc or None)
    print(Path(paths[1]).read_text())
    for path in paths:
        print(f"wrote {path}")
    return 0
