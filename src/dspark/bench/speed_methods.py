"""`dspark bench speed`: its settings, its prompts and its methods (the rows of the table).

A method is a callable that decodes one prompt at batch size 1 and returns the new tokens plus, for our engine,
the per-step draft and verify times; ``build_methods`` loads every model the settings ask for once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from dspark.errors import DSparkError
from dspark.data.eval_sets import BENCHMARKS, DEFAULT_SEED
from dspark.drafters.options import DraftingOptions
from dspark.target.presets import DEFAULT_TARGET

HF_PLAIN, OURS_PLAIN = "hf-generate", "ours-plain"


def greedy_reference(method: str) -> str | None:
    """Whose greedy text a row must reproduce: ours-plain for our drafting rows (lossless decoding), hf-generate for
    transformers' drafting rows and for ours-plain itself (our implementation against theirs)."""
    if method == HF_PLAIN:
        return None
    return HF_PLAIN if method.startswith("hf-") or method == OURS_PLAIN else OURS_PLAIN


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
    device: str = "cpu"  # cpu | cuda: target, drafters and the HF models
    compile: bool = False  # "+compile" twins of ours-plain and each --drafter row (its last variant), compiled target
    head_top_m: list[int] | None = None  # DSpark rows at each M too (--head-top-m); None: the full head only
    draft_vocab: str | None = None  # DSpark/DFlash rows with this draft vocabulary too (and the last M, if any)
    hybrid: bool = False  # a "+hybrid" row per --drafter: its cheapest variant with prompt lookup on repeats
    hybrid_min_ngram: int = 3
    hybrid_static: bool = False  # also a "+hybrid-static" row: lookup on long matches only, no adaptive choice
    jsonl: list[list[str]] = field(default_factory=list)  # [NAME, FILE] prompt sets beside --sets
    policy: str = "all"  # how the --drafter rows verify (rows named '<row>/POLICY' unless all); see ``_policy_rows``


# ---------------------------------------------------------------- prompts

@dataclass
class BenchPrompt:
    dataset: str
    idx: int
    ids: list[int]
    seed: int


def select_prompts(target, cfg: SpeedConfig) -> list[BenchPrompt]:
    """The first ``per_set`` prompts of each set (DeepSpec's shuffled selection) that fit the limits."""
    from dspark.data.eval_sets import load_eval_dataset, load_jsonl_dataset

    prompts: list[BenchPrompt] = []
    sets = [(name, lambda n=name: load_eval_dataset(n, cfg.eval_dir, None, cfg.seed)) for name in cfg.sets]
    sets += [(name, lambda n=name, f=path: load_jsonl_dataset(f, n, seed=cfg.seed)) for name, path in cfg.jsonl]
    for name, load in sets:
        taken = 0
        for sample in load().samples:
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


def ours_method(name: str, target, drafter, note: str = "", policy=None) -> Method:
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    gen = SpeculativeGenerator(target, drafter, policy)

    def run(ids: list[int], temperature: float, seed: int, max_new: int) -> tuple[list[int], dict]:
        gen.timings = log = _StepLog()
        [res] = gen.generate([ids], SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed))
        end = time.perf_counter()
        return res.output_ids, {
            "decode_s": end - log.first_step_start if log.first_step_start is not None else 0.0,
            "steps": log.steps, "committed": res.stats.sum_acceptance_length, "draft_s": log.draft_s,
            "verify_s": log.verify_s, "step_draft_s": [d for d, _ in log.per_step],
            "step_verify_s": [v for _, v in log.per_step], "verified": log.verified_tokens,
        }

    block = getattr(drafter, "block_size", None) or None
    return Method(name, "ours", block, run, _module_mib(getattr(drafter, "model", None)), note)


def hf_method(name: str, model, target, block_size: int | None = None, note: str = "", **generate_kwargs) -> Method:
    import torch

    eos = list(target.eos_token_ids)
    pad = eos[0] if eos else None

    def run(ids: list[int], temperature: float, seed: int, max_new: int) -> tuple[list[int], dict]:
        input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
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
    from dspark.target.loading import torch_dtype

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
        hf = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=dtype).to(cfg.device).eval()
        methods.append(hf_method(HF_PLAIN, hf, target))
        k = cfg.prompt_lookup_tokens
        methods.append(hf_method("hf-prompt-lookup", hf, target, k, f"prompt_lookup_num_tokens={k}",
                                 prompt_lookup_num_tokens=k))
        if cfg.draft_lm:
            assistant = AutoModelForCausalLM.from_pretrained(cfg.draft_lm, dtype=dtype).to(cfg.device).eval()
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
    twins = [(OURS_PLAIN, NoDrafter(target.vocab_size), _PolicyRows("all"))]  # rows that get a "+compile" twin
    methods.append(ours_method(OURS_PLAIN, target, twins[0][1]))
    methods.append(ours_method("ours-prompt-lookup", target, load_drafter(
        "prompt-lookup", target, DraftingOptions(block_size=cfg.prompt_lookup_tokens))))
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
            policy = _policy_rows(cfg, target, drafter, path, f"ours-{name}", log)
            methods.append(ours_method(policy.name(f"ours-{name}"), target, drafter, policy.note, policy.make()))
            last = (f"ours-{name}", drafter)
            for suffix, m, vocab, note in _variants(own, cfg):
                last = (f"ours-{name}{suffix}", load_drafter(path, target, DraftingOptions(block_size=k, head_top_m=m, draft_vocab=vocab)))
                methods.append(ours_method(policy.name(last[0]), target, last[1], policy.join(note), policy.make()))
            if cfg.hybrid:
                from dspark.drafters.hybrid import HybridDrafter

                n = cfg.hybrid_min_ngram
                methods.append(ours_method(policy.name(f"{last[0]}+hybrid"), target, HybridDrafter(
                    last[1], target.vocab_size, min_ngram=n), policy.join(
                    f"prompt lookup where the context repeats a {n}-gram, or a shorter n-gram when its running "
                    f"acceptance pays more than {last[0]}'s, else {last[0]} (--hybrid)"), policy.make()))
                if cfg.hybrid_static:
                    methods.append(ours_method(policy.name(f"{last[0]}+hybrid-static"), target, HybridDrafter(
                        last[1], target.vocab_size, min_ngram=n, adaptive=False), policy.join(
                        f"prompt lookup where the context repeats a {n}-gram, else {last[0]} (no adaptive choice)"),
                        policy.make()))
            twins.append((policy.name(last[0]), last[1], policy))  # each drafter's compiled twin: its cheapest variant
    if compiled_target is not None:  # drafters read no target weights while drafting: shared with the twin
        methods += [ours_method(f"{name}+compile", compiled_target, drafter, policy.note, policy.make())
                    for name, drafter, policy in twins]
    names = [(m.name, m.block_size) for m in methods]
    if len(set(names)) != len(names):
        raise DSparkError("two rows share a name and block size; give each --drafter a distinct NAME")
    return methods


@dataclass
class _PolicyRows:
    """How one --drafter's rows verify (``SpeedConfig.policy``): their names, notes and a fresh policy per row."""

    spec: str
    cost: object = None  # the profiled step cost (alg1, async) or None
    sts: list[float] | None = None

    def name(self, row: str) -> str:
        return row if self.spec == "all" else f"{row}/{self.spec}"

    @property
    def note(self) -> str:
        if self.spec == "all":
            return ""
        planned = " on the step's cost profiled at one request at the start" if self.cost is not None else ""
        sts = ", STS from its sts.json" if self.sts is not None else ""
        return f"verifies as {self.spec} plans{planned}{sts} (--policy)"

    def join(self, note: str) -> str:
        return "; ".join(part for part in (note, self.note) if part)

    def make(self):
        """A new policy for one row (a policy keeps per-request records), or None: verify every draft."""
        if self.spec == "all":
            return None
        from dspark.scheduler.adapter import make_policy

        return make_policy(self.spec, self.cost, self.sts)


def _policy_rows(cfg: SpeedConfig, target, drafter, checkpoint: str, row: str, log) -> _PolicyRows:
    """The --policy of ``drafter``'s rows: for alg1 / async its whole step profiled now at one request (the benchmark
    decodes one prompt at a time), as `dspark demo` plans; STS from ``checkpoint``/sts.json where there is one."""
    from dspark.generation.step_profile import policy_inputs
    from dspark.scheduler.adapter import parse_policy

    if parse_policy(cfg.policy).kind == "all":
        return _PolicyRows("all")
    cost, sts = policy_inputs(cfg.policy, target, drafter, checkpoint, log=lambda line: log(f"[speed] {row}: {line}"))
    return _PolicyRows(cfg.policy, cost, sts)


def _variants(drafter, cfg: SpeedConfig) -> list[tuple[str, int | None, str | None, str]]:
    """(row suffix, head_top_m, draft_vocab, note) of the cheaper-drafting rows a drafter gets."""
    from dspark.drafters.dspark.drafter import DSparkDrafter

    if not isinstance(drafter, DSparkDrafter):  # the variants are DSpark/DFlash loading options
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
