"""The Python side of scripts/serving_peers.sh (``dspark.studies.serving_peers``).

    python scripts/serving_peers_report.py note --work runs/peers --name dspark-plain --engine dspark \
        --method plain --status measured --command "..." --ready-s 31 --load-before 0.4 --load-after 0.9
    python scripts/serving_peers_report.py spec-config < printed-launch-command.txt
    python scripts/serving_peers_report.py write --work runs/peers --out-dir docs/serving --model DIR \
        --concurrency 1,4,16,32 --num-requests 32 --max-tokens 64 --command "..." --full-command "..." [--smoke]

`note` records one row (its measurement is WORK/NAME/serve_load.json, from `dspark bench serve --url`),
`spec-config` prints the --speculative-config JSON of the launch command `dspark export --to vllm` printed, and
`write` writes peers.md, peers.json and peers.png.
"""

from __future__ import annotations

import argparse
import os
import sys

from dspark.studies.serving_peers import note_row, speculative_config, write_peers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    n = sub.add_parser("note", help="record one row")
    n.add_argument("--work", required=True)
    n.add_argument("--name", required=True)
    n.add_argument("--engine", required=True, choices=["vllm", "dspark"])
    n.add_argument("--method", required=True)
    n.add_argument("--status", required=True, choices=["measured", "skipped", "failed"])
    n.add_argument("--command", default=None)
    n.add_argument("--reason", default=None)
    n.add_argument("--ready-s", type=float, default=None)
    n.add_argument("--load-before", type=float, default=None)
    n.add_argument("--load-after", type=float, default=None)
    sub.add_parser("spec-config", help="stdin: what `dspark export --to vllm` printed")
    w = sub.add_parser("write", help="peers.md, peers.json, peers.png")
    w.add_argument("--work", required=True)
    w.add_argument("--out-dir", required=True)
    w.add_argument("--model", required=True)
    w.add_argument("--concurrency", required=True)
    w.add_argument("--num-requests", type=int, required=True)
    w.add_argument("--max-tokens", type=int, required=True)
    w.add_argument("--temperature", type=float, default=0.0, help="the load's sampling temperature")
    w.add_argument("--command", required=True)
    w.add_argument("--full-command", required=True)
    w.add_argument("--cpus", default="", help="the cores every server was confined to (CPUS), if any")
    w.add_argument("--smoke", action="store_true", help="parameters below the full run's: label it so")
    args = ap.parse_args(argv)
    if args.what == "note":
        fields = ("name", "engine", "method", "status", "command", "reason", "ready_s", "load_before", "load_after")
        note_row(args.work, {k: getattr(args, k) for k in fields})
    elif args.what == "spec-config":
        print(speculative_config(sys.stdin.read()))
    else:
        config = {"model": args.model, "concurrency": args.concurrency, "num_requests": args.num_requests,
                  "max_tokens": args.max_tokens, "temperature": args.temperature, "cpu_count": os.cpu_count(),
                  "cpus": args.cpus}
        for path in write_peers(args.work, args.out_dir, config, args.command, args.full_command, args.smoke):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
