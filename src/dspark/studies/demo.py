"""`dspark demo`: the README's main command.

Prepares the default target, takes the shipped reference drafter
(``checkpoints/smollm2-135m-dspark`` in the repository; ``--drafter`` names
another, ``--train`` trains a small one from scratch in a few minutes), decodes
a few evaluation prompts with plain decoding, prompt lookup, DSpark and hybrid
drafting (prompt lookup where the answer repeats its context, DSpark elsewhere),
and prints acceptance length and speedup. The DSpark and hybrid rows verify as
``--policy`` plans: by default Algorithm 1 on the whole step's cost, profiled at
the start at one request, and the drafter's ``sts.json``; ``all`` verifies every
draft. Greedy, so every row must produce the target's own text, exactly, and the
demo fails otherwise. On a CPU with bf16
matmul units it decodes in bfloat16 with one-token steps computed as verify
blocks compute their rows (``TargetModel.make_batch_invariant``, checked on
the model at load), the faster of the two exact settings there (README; the
`dspark demo --dtype float32` run beside it). Elsewhere float32.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dspark.target.presets import dspark_home
from dspark.cli_options import drafting_options, load_target_from_args
from dspark.target.loading import resolve_device
from dspark.tables import fmt, markdown_table

DEMO_SETS = ("gsm8k", "humaneval", "mt-bench")
REFERENCE = Path("checkpoints") / "smollm2-135m-dspark"  # the shipped drafter, relative to the repository


def reference_drafter() -> Path | None:
    """The shipped reference drafter: in the working directory's repository, else beside this source tree."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / REFERENCE / "config.json").is_file():
            return root / REFERENCE
    return None


def _find_drafter(args: argparse.Namespace, work: Path) -> Path | None:
    """--drafter, else (without --train) the shipped reference drafter, else a demo drafter trained earlier."""
    from dspark.training.checkpoints import latest_checkpoint

    if args.drafter:
        return Path(args.drafter)
    if not args.train and (ref := reference_drafter()) is not None:
        return ref
    out = work / "drafter"  # an earlier `dspark demo --train` (resumed if unfinished)
    ckpt = latest_checkpoint(out) if out.exists() else None
    if ckpt is not None and (ckpt / "config.json").is_file() and (out / "train_summary.json").is_file():
        return ckpt
    return None


def _draft_vocab(args: argparse.Namespace, ckpt: Path, target, work: Path) -> str | None:
    """--draft-vocab, else one built from the tokenized data the drafter was trained on (None if there is none)."""
    import json

    from dspark.data.vocab import write_draft_vocab

    if args.draft_vocab or args.draft_vocab_size <= 0 or _has_own_vocab(ckpt):
        return args.draft_vocab
    cfg_path = ckpt / "train_config.json"
    data = json.loads(cfg_path.read_text()).get("data") if cfg_path.is_file() else None
    for folder in ([data] if isinstance(data, str) else data or []):
        if (Path(folder) / "manifest.json").is_file():
            path = work / "draft-vocab.json"
            ids, coverage, _ = write_draft_vocab(folder, target, args.draft_vocab_size, path)
            print(f"[demo] draft vocabulary: the {len(ids)} most frequent tokens of {folder} "
                  f"({coverage:.1%} of its answer tokens) -> {path}")
            return str(path)
    return None


def _has_own_vocab(ckpt: Path) -> bool:
    """Whether the checkpoint carries its draft vocabulary (then it needs no side file)."""
    import json

    cfg = json.loads((ckpt / "config.json").read_text()) if (ckpt / "config.json").is_file() else {}
    return bool(cfg.get("draft_vocab_size"))


def _train_demo_drafter(args: argparse.Namespace, target, work: Path) -> Path:
    from dspark.training.config import load_config
    from dspark.data.tokenized import write_tokenized
    from dspark.data.prompts import build_prompt_set
    from dspark.data.regenerate import regenerate
    from dspark.training.trainer import train

    work.mkdir(parents=True, exist_ok=True)
    prompts, regen, tok = work / "prompts.jsonl", work / "regenerated.jsonl", work / "tok"
    print(f"[demo] no trained drafter found: building {args.num_train_prompts} training prompts and letting the "
          f"target answer them (resumable, in {work})")
    if not prompts.is_file():
        build_prompt_set(prompts, args.num_train_prompts, seed=1)
    regenerate(target, prompts, regen, batch_size=16, max_new_tokens=160, seed=1)
    if not (tok / "manifest.json").is_file():
        write_tokenized(regen, target.tokenizer, tok, max_length=512)
    print(f"[demo] training a 1-layer DSpark drafter (Markov head) for {args.train_minutes:g} min")
    cfg = load_config(
        "smollm2-dspark-markov",
        [f"time_budget_s={args.train_minutes * 60:.0f}", "epochs=20", "max_length=512", "checkpoint_every=50",
         f"dtype={args.dtype}", f"device={args.device}"],
        target=args.target, data=[str(tok)], out=str(work / "drafter"),
    )
    return train(cfg, resume=True, target=target)  # an unfinished demo training continues; none: step 0


def _policies(args: argparse.Namespace, spec, target, dspark, ckpt: Path) -> tuple:
    """The verify policies of the DSpark row and the hybrid row (one each: a policy keeps per-request records), or
    (None, None) for ``--policy all``. The schedulers plan on this machine's step cost, profiled now at one request
    (the demo decodes one prompt at a time), and on the drafter's STS temperatures when it has an sts.json."""
    from dspark.generation.step_profile import policy_inputs
    from dspark.scheduler.adapter import make_policy

    if spec.kind == "all":
        return None, None
    cost, sts = policy_inputs(args.policy, target, dspark, ckpt, log=lambda line: print(f"[demo] {line}"))
    return make_policy(args.policy, cost, sts), make_policy(args.policy, cost, sts)


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from dspark.drafters.base import NoDrafter
    from dspark.drafters.hybrid import HybridDrafter
    from dspark.drafters.prompt_lookup import PromptLookupDrafter
    from dspark.drafters.registry import load_drafter
    from dspark.data.eval_sets import load_eval_dataset
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams
    from dspark.scheduler.adapter import parse_policy
    from dspark.target.model import cpu_has_bf16_matmul

    t_start = time.perf_counter()
    policy_spec = parse_policy(args.policy)  # a bad --policy fails before anything loads
    auto_bf16 = args.dtype is None and resolve_device(args.device) == "cpu" and cpu_has_bf16_matmul()
    if auto_bf16:  # bf16 where it is fast and can be made exact, else float32
        args.dtype = "bfloat16"
    target = load_target_from_args(args)
    if auto_bf16 and not target.batch_invariant:
        print("[demo] bfloat16 is not batch-invariant on this CPU; decoding in float32 instead")
        args.dtype = "float32"
        target = load_target_from_args(args)
    strict = args.dtype == "float32" or bool(target.batch_invariant)  # every row must equal plain decoding
    print(f"[demo] target {args.target}: {target.num_layers} layers, vocab {target.vocab_size} ({target.path})")
    work = Path(args.work_dir) if args.work_dir else dspark_home() / "demo"
    ckpt = _find_drafter(args, work)
    if ckpt is None:
        ckpt = _train_demo_drafter(args, target, work)
    print(f"[demo] DSpark drafter: {ckpt}")
    dspark = load_drafter(str(ckpt), target, drafting_options(
        args, hybrid=False, draft_vocab=_draft_vocab(args, ckpt, target, work)))
    hybrid = HybridDrafter(dspark, target.vocab_size, min_ngram=args.hybrid_min_ngram)
    prompts = []
    for name in DEMO_SETS:
        for s in load_eval_dataset(name, limit=args.prompts_per_set).samples:
            prompts.append((name, target.encode_chat(s.prompt)))
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    policies = _policies(args, policy_spec, target, dspark, ckpt)  # the DSpark row's and the hybrid row's (None: verify all)
    gens = {
        "plain (no drafter)": SpeculativeGenerator(target, NoDrafter(target.vocab_size)),
        "prompt lookup": SpeculativeGenerator(target, PromptLookupDrafter(target.vocab_size, 7)),
        "DSpark": SpeculativeGenerator(target, dspark, policies[0]),
        "hybrid (prompt lookup on repeats, else DSpark)": SpeculativeGenerator(target, hybrid, policies[1]),
    }
    for gen in gens.values():  # warm-up
        gen.generate([prompts[0][1]], SamplingParams(temperature=0.0, max_new_tokens=4))
    # each prompt through every row in turn: a slow spell of the machine (other tenants, clock changes) then slows
    # every row alike instead of the one row that happened to run through it, so the speedups stay ratios of one run
    runs = {label: {"outputs": [], "tokens": 0, "seconds": 0.0, "taus": []} for label in gens}
    for _, ids in prompts:
        for label, gen in gens.items():
            t0 = time.perf_counter()
            with torch.inference_mode():
                res = gen.generate([ids], sp)[0]
            r = runs[label]
            r["seconds"] += time.perf_counter() - t0
            r["tokens"] += len(res.output_ids)
            r["outputs"].append(res.output_ids)
            r["taus"].append(res.stats.acceptance_length)
    reference = runs[next(iter(runs))]["outputs"]
    rows = [(label, sum(r["taus"]) / len(r["taus"]), r["tokens"] / r["seconds"],
             sum(out == ref for out, ref in zip(r["outputs"], reference))) for label, r in runs.items()]
    base = rows[0][2]
    top_m, vocab = getattr(dspark, "head_top_m", None), getattr(dspark, "draft_vocab", None)
    print(f"\n{len(prompts)} prompts ({', '.join(DEMO_SETS)}), greedy, {args.max_new_tokens} new tokens max, "
          f"{args.dtype}{', compiled' if args.compile else ''}; DSpark head over "
          f"{f'the top {top_m}' if top_m else 'all'} tokens, draft vocabulary of "
          f"{'all' if vocab is None else len(vocab)} tokens; the DSpark and hybrid rows verify "
          f"{'every draft' if policies[0] is None else f'as {args.policy} plans'}\n")
    table = [[label, fmt(tau), fmt(tps, 1), f"{fmt(tps / base)}x",
              "yes" if same == len(prompts) else f"{same}/{len(prompts)} prompts"] for label, tau, tps, same in rows]
    print("\n".join(markdown_table(["decoding", "acceptance length", "tokens/s", "speedup", "same text as plain"],
                                   table)))
    exact = all(r[3] == len(prompts) for r in rows)
    if not exact and not strict:
        print("\nIn bfloat16 here a verify block and a single decode step round differently, so a near-tied greedy "
              "choice can flip and the texts then diverge; this is rounding, not a change of distribution. "
              "`dspark demo --dtype float32` decodes exactly the plain text (and fails if it does not).")
    print(f"\n[demo] done in {time.perf_counter() - t_start:.0f} s")
    return 0 if exact or not strict else 1
