"""`dspark data ...`: build training prompts and tokenize conversations (`regenerate` and `features`
are registered from dspark.training.cli).

The main CLI calls `add_cli(subparsers)` with the object returned by `parser.add_subparsers()`.
Typical pipeline:

    dspark data prompts --out data/prompts.jsonl --num 20000 --seed 0
    dspark data regenerate ...            # answers the prompts with the target
    dspark data tokenize --in data/regenerated.jsonl --target smollm2-135m --out data/tok
    dspark data features ...              # optional: cache the target's features
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_MIX_SPEC = "math=0.4,code=0.3,chat=0.3"


def _parse_weights(spec: str | None) -> dict[str, float] | None:
    from dspark.errors import DSparkError

    if not spec:
        return None
    try:
        return {k.strip(): float(v) for k, v in (part.split("=") for part in spec.split(",") if part.strip())}
    except ValueError as err:
        raise DSparkError(f"bad --source-weights {spec!r}: write it as gsm_symbolic=0,stdlib=2") from err


def _overlap(value: str) -> float | None:
    return None if value.lower() in ("off", "none") else float(value)


def run_prompts(args: argparse.Namespace) -> None:
    from dspark.data.prompts import build_prompt_set, default_sources, substitute_alpaca

    sources = default_sources(python_doc_dir=args.python_doc_dir, evals_path=args.evals_wheel,
                              weights=_parse_weights(args.source_weights))
    summary = build_prompt_set(args.out, args.num, mix=args.mix, seed=args.seed, eval_dir=args.eval_dir,
                               sources=sources, max_eval_overlap=args.max_eval_overlap,
                               allow_short=args.allow_short)
    print(summary)
    if args.alpaca_substitute:
        print(substitute_alpaca(args.alpaca_substitute, args.alpaca_num, seed=args.seed, eval_dir=args.eval_dir,
                                sources=sources, max_eval_overlap=args.max_eval_overlap))


def run_tokenize(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from dspark.target.convert import resolve_model_path
    from dspark.data.tokenized import write_tokenized

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.target))
    print(write_tokenized(args.inputs, tokenizer, args.out, args.max_length, args.min_loss_tokens))


def run_vocab(args: argparse.Namespace) -> None:
    from dspark.drafters.draft_vocab import write_draft_vocab
    from dspark.target.model import load_target

    ids, coverage, counts = write_draft_vocab(args.data, load_target(args.target), args.size, args.out)
    print(f"wrote {args.out}: {len(ids)} tokens covering {coverage:.2%} of {int(counts.sum())} supervised tokens "
          f"({int((counts > 0).sum())} distinct)")


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `dspark data {prompts,tokenize}` on the main CLI's subparsers."""
    from dspark.target.presets import DEFAULT_TARGET
    from dspark.data.chat import MIN_LOSS_TOKENS

    data = subparsers.add_parser(
        "data", help="build training data: prompts, regenerated responses, tokenized dataset",
        description="Offline training-data pipeline: `prompts` -> `regenerate` -> `tokenize` "
                    "(-> `features`, an optional cache of the target's hidden states).")
    commands = data.add_subparsers(dest="data_command", required=True)

    prompts = commands.add_parser(
        "prompts", help="write a JSONL of training prompts from offline package data",
        description="Build training prompts (math: reasoning-gym generators; code: reasoning-gym "
                    "codeio-hq and CPython standard-library functions; chat: chatterbot-corpus, Python "
                    "documentation and docstrings, optional OpenAI `evals` data) with no network access. Prompts "
                    "that match, contain or lie inside a first turn of any evaluation set are dropped. "
                    "Needs `pip install 'dspark[data]'` for math prompts.")
    prompts.add_argument("--out", type=Path, required=True, metavar="FILE", help="output JSONL file")
    prompts.add_argument("--num", type=int, required=True, metavar="N", help="number of prompts to write")
    prompts.add_argument("--mix", default=DEFAULT_MIX_SPEC,
                         help="domain proportions, normalised to sum 1 (default: %(default)s)")
    prompts.add_argument("--seed", type=int, default=0, metavar="S",
                         help="the same seed reproduces the file (default: %(default)s)")
    prompts.add_argument("--eval-dir", type=Path, default=None, metavar="DIR",
                         help="folder of evaluation {\"turns\": [...]} JSONL files to stay disjoint from "
                              "(default: $DSPARK_EVAL_DIR, else ../shared/data/eval next to the repository)")
    prompts.add_argument("--max-eval-overlap", type=_overlap, default=0.5,
                         help="drop prompts sharing more than this share of their word 8-grams (numbers "
                              "masked) with the evaluation sets; 'off' disables (default: %(default)s)")
    prompts.add_argument("--source-weights", default=None,
                         help="override source weights within a domain, e.g. gsm_symbolic=0,stdlib=2 "
                              "(sources: gsm_symbolic, rg_math, codeio, stdlib, chatterbot, python_docs, "
                              "pydoc_topics, stdlib_docs, openai_evals; 0 disables one)")
    prompts.add_argument("--python-doc-dir", type=Path, default=None, metavar="DIR",
                         help="reST sources of the Python docs (default: /usr/share/doc/python3.X/html/"
                              "_sources from Debian's python3.X-doc, skipped when absent)")
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

    # ---- `dspark data regenerate` and `dspark data features` are defined in dspark.training.cli ----
    from dspark.training.cli import add_data_commands

    add_data_commands(commands)

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
