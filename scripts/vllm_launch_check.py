"""Issue 24 item 3(c): the launch command `dspark export --to vllm` prints starts a vLLM server that answers a chat
request with drafts verified, and the greedy answer is the target's own.

    VLLM_VENV=/work/vllm-venv python scripts/vllm_launch_check.py \
        --drafter eagle3=CKPT --drafter dflash=CKPT [--target smollm2-135m]

For each checkpoint, one server at a time:
1. runs `dspark export --to vllm CKPT OUT --target DIR --target-folder DIR` and takes the command it prints;
2. runs that command as printed, with the venv's python for `python`, plus `--host 127.0.0.1 --port P`, and, on
   this CPU, `--enforce-eager` (without it vLLM's CPU build compiles the model for minutes before serving) and
   `--dtype float32` (so the answer can be compared with the in-process float32 target's);
3. sends one chat completion (greedy, --max-tokens) and checks that the answer equals the in-process greedy
   answer to the same message, that vLLM counted drafts on /metrics (`vllm:spec_decode_num_drafts_total` > 0),
   and reports its acceptance length (1 + accepted / drafts);
4. stops the server (its whole process group) and writes the outcome between the markers in --doc
   (docs/interop.md) and to --work/launch.json.
Exits 1 when a check fails, 2 when vLLM is missing or of another version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_vllm import write_between  # noqa: E402
from regenerate_vllm import ROOT, VllmServer, _http, check_vllm, default_vllm_python  # noqa: E402

START, END = "<!-- vllm-launch:start -->", "<!-- vllm-launch:end -->"
#: the check's additions to the printed command, and why (the docs table says it)
EXTRA = ["--enforce-eager", "--dtype", "float32"]
MESSAGE = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?")


def printed_command(ckpt: str, out: Path, target_dir: str) -> str:
    cmd = [sys.executable, "-m", "dspark.cli", "--threads", "1", "export", "--to", "vllm", ckpt, str(out),
           "--target", target_dir, "--target-folder", target_dir]
    printed = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE).stdout
    command = printed.strip().splitlines()[-1]
    if "--speculative-config" not in command:
        raise SystemExit(f"dspark export printed no launch command: {printed!r}")
    return command


class PrintedServer(VllmServer):
    """``VllmServer`` running a printed command (its ``python`` replaced by the venv's) instead of its own."""

    def __init__(self, command: str, python: str, port: int, log: Path, wait_s: float) -> None:
        super().__init__(python, "", port, "", log, wait_s)
        argv = shlex.split(command)
        if argv[0] != "python":
            raise SystemExit(f"the printed command does not start with `python`: {command}")
        self.argv = [python, *argv[1:], *EXTRA, "--host", "127.0.0.1", "--port", str(port)]
        self.model = argv[argv.index("--model") + 1]


def in_process_answer(target_dir: str, max_tokens: int) -> str:
    import torch

    from dspark.data.regenerate_engine import decode_reply
    from dspark.target.loading import load_decoding_target
    from dspark.generation.generator import SpeculativeGenerator
    from dspark.sampling.processing import SamplingParams

    torch.set_num_threads(1)
    target = load_decoding_target(target_dir, "cpu", "float32")
    ids = target.encode_chat(MESSAGE)
    res = SpeculativeGenerator(target).generate([ids], [SamplingParams(0.0, 0, 1.0, max_tokens, seed=0)], ["0"])[0]
    return decode_reply(target, res.output_ids, res.finish_reason)


def spec_counters(metrics: str) -> tuple[float, float]:
    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$", metrics, re.M))
    return total("spec_decode_num_drafts"), total("spec_decode_num_accepted_tokens")


def check(name: str, command: str, python: str, port: int, work: Path, expected: str, max_tokens: int,
          wait_s: float) -> dict:
    row = {"drafter": name, "command": command, "extra_flags": " ".join(EXTRA), "started": False}
    try:
        with PrintedServer(command, python, port, work / f"launch-{name}.log", wait_s) as server:
            row["started"], row["ready_s"] = True, round(server.ready_s, 1)
            body = {"model": server.model, "messages": [{"role": "user", "content": MESSAGE}],
                    "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            reply = json.loads(_http(server.base + "/v1/chat/completions", body, timeout=600))
            row["answer_s"] = round(time.perf_counter() - t0, 1)
            row["answer"] = reply["choices"][0]["message"]["content"]
            drafts, accepted = spec_counters(_http(server.base + "/metrics"))
    except SystemExit as err:  # the server exited or never answered /health
        row["error"] = str(err)
        return {**row, "ok": False}
    row.update(num_drafts=drafts, num_accepted_tokens=accepted,
               tau_vllm=round(1 + accepted / drafts, 3) if drafts else None,
               answer_equal=row["answer"] == expected)
    row["ok"] = bool(row["answer"]) and drafts > 0 and row["answer_equal"]
    return row


def write_doc(doc: Path, rows: list[dict], version: str, command: str, max_tokens: int) -> None:
    lines = [START, "", f"    {command}", "",
             f"vLLM {version} (CPU build). Each row: the command `dspark export --to vllm` printed, started as printed "
             f"plus `--host 127.0.0.1 --port P {' '.join(EXTRA)}`, one chat completion (greedy, {max_tokens} "
             "tokens, a GSM8K question), the answer compared with the in-process float32 target's greedy answer "
             "to the same message, and vLLM's draft counters read from `/metrics`.", "",
             "| drafter | printed command | server up (s) | answer (s) | drafts verified | tau vLLM | "
             "answer equal to in-process greedy | works |", "|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if not r["started"]:
            lines.append(f"| {r['drafter']} | `{r['command']}` | – | – | – | – | – | "
                         f"no: {r.get('error', '')} |")
            continue
        lines.append(f"| {r['drafter']} | `{r['command']}` | {r['ready_s']:.0f} | {r['answer_s']:.0f} | "
                     f"{r['num_drafts']:.0f} | {r['tau_vllm']} | {'yes' if r['answer_equal'] else 'no'} | "
                     f"{'yes' if r['ok'] else 'no'} |")
    block = "\n".join(lines + ["", END])
    write_between(doc, START, END, block)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=default_vllm_python(), help="(default: $VLLM_VENV/bin/python)")
    p.add_argument("--target", default="smollm2-135m", help="target preset or HF folder (vLLM reads the folder)")
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=CKPT")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--wait-s", type=float, default=600)
    p.add_argument("--work", type=Path, default=Path("runs/vllm-launch"))
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "interop.md")
    args = p.parse_args(argv)
    venv = f"VLLM_VENV={os.environ['VLLM_VENV']} " if os.environ.get("VLLM_VENV") else ""
    command = f"{venv}python scripts/vllm_launch_check.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    version = check_vllm(args.vllm_python)
    from dspark.target.convert import resolve_model_path

    target_dir = str(resolve_model_path(args.target))
    args.work.mkdir(parents=True, exist_ok=True)
    expected = in_process_answer(target_dir, args.max_tokens)
    print(f"in-process greedy answer: {expected!r}", flush=True)
    rows = []
    for i, spec in enumerate(args.drafter):
        name, _, ckpt = spec.partition("=")
        printed = printed_command(ckpt, args.work / f"export-{name}", target_dir)
        rows.append(check(name, printed, args.vllm_python, args.port + i, args.work, expected, args.max_tokens,
                          args.wait_s))
        print(json.dumps(rows[-1]), flush=True)
    (args.work / "launch.json").write_text(json.dumps({"expected": expected, "rows": rows}, indent=2) + "\n")
    write_doc(args.doc, rows, version, command, args.max_tokens)
    print(f"wrote {args.doc}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
