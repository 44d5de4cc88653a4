"""`dspark data regenerate` through vLLM's OpenAI server against the in-process path: same prompts, greedy.

Starts vLLM's server (its CPU build, float32) on 127.0.0.1 for the target, regenerates --num prompts from
`dspark data prompts` with `--base-url` (concurrency --concurrency), then the same prompts in-process
(`--batch-size` the same number), and compares the records: the assistant turns must be equal, token for token
in text. Both rates (records/s, new tokens/s of answer text counted with the target's tokenizer) are measured in
this one run, on the same machine, and appended as a section of docs/data-throughput.md (--doc).

usage: python bench/interop_regenerate.py --vllm-python .venv-vllm/bin/python [--num 16] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Through vLLM's server (measured)"


def dspark(*args: str) -> float:
    cmd = [sys.executable, "-m", "dspark.cli", "--threads", os.environ.get("DSPARK_THREADS", "1"), *args]
    print("+ dspark " + " ".join(shlex.quote(a) for a in args), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def answers(path: Path) -> dict[str, list[str]]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[str(rec["id"])] = [m["content"] for m in rec["conversations"] if m["role"] == "assistant"]
    return out


def start_server(python: str, target: str, port: int, log: Path, wait_s: float = 900) -> subprocess.Popen:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    print("+ " + " ".join(shlex.quote(a) for a in argv), flush=True)
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM's server exited ({proc.returncode}); see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            return proc
        except OSError:
            time.sleep(5)
    stop(proc)
    raise SystemExit(f"vLLM's server did not answer /health in {wait_s} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--port", type=int, default=8777)
    p.add_argument("--work", default="runs/interop-regenerate")
    p.add_argument("--doc", default=str(ROOT / "docs" / "data-throughput.md"))
    args = p.parse_args()

    from dspark.target.convert import resolve_model_path
    from transformers import AutoTokenizer

    target = str(resolve_model_path(args.target))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    if not prompts.exists():
        dspark("data", "prompts", "--out", str(prompts), "--num", str(args.num))
    common = ["--prompts", str(prompts), "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens),
              "--limit", str(args.num)]
    for f in ("http.jsonl", "local.jsonl"):
        (work / f).unlink(missing_ok=True)
    server = start_server(args.vllm_python, target, args.port, work / "vllm-server.log")
    try:
        http_s = dspark("data", "regenerate", *common, "--out", str(work / "http.jsonl"),
                        "--base-url", f"http://127.0.0.1:{args.port}/v1", "--concurrency", str(args.concurrency))
    finally:
        stop(server)
    local_s = dspark("data", "regenerate", *common, "--out", str(work / "local.jsonl"), "--target", target,
                     "--batch-size", str(args.concurrency))
    http, local = answers(work / "http.jsonl"), answers(work / "local.jsonl")
    tok = AutoTokenizer.from_pretrained(target)
    new_tokens = {name: sum(len(tok.encode(t, add_special_tokens=False)) for turns in recs.values() for t in turns)
                  for name, recs in (("http", http), ("local", local))}
    equal = sum(http.get(k) == v for k, v in local.items())
    rows = [("vLLM 0.32.0 server (CPU build, float32), `--base-url`, concurrency " + str(args.concurrency),
             len(http), new_tokens["http"], http_s),
            (f"in-process engine (float32), `--batch-size {args.concurrency}`", len(local), new_tokens["local"],
             local_s)]
    cmd = (f"python bench/interop_regenerate.py --vllm-python VLLM_PYTHON --num {args.num} --max-new-tokens "
           f"{args.max_new_tokens} --concurrency {args.concurrency}")
    lines = [SECTION, "", f"    {cmd}", "",
             f"Greedy (`--temperature 0`), {args.num} prompts from `dspark data prompts`, `--max-new-tokens "
             f"{args.max_new_tokens}`, target {args.target}, `dspark --threads 1`; both paths in the same run on the "
             "same shared 2-core machine, so only their ratio means anything. Seconds are the whole command "
             "(the server's start-up is not counted; the in-process path loads the target inside its time). "
             "New tokens = the answers re-tokenized with the target's tokenizer.", "",
             "| path | records | new tokens | seconds | records/s | new tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    for name, n, t, s in rows:
        lines.append(f"| {name} | {n} | {t} | {s:.1f} | {n / s:.3f} | {t / s:.1f} |")
    lines += ["", f"Records whose assistant turns are equal on both paths: {equal}/{len(local)}.", ""]
    doc = Path(args.doc)
    text = doc.read_text()
    block = "\n".join(lines)
    if SECTION in text:  # rerun: replace this section only (up to the next heading or the end)
        head, rest = text.split(SECTION, 1)
        nxt = rest.find("\n## ")
        text = head + block + (rest[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    doc.write_text(text)
    print(block)
    return 0 if equal == len(local) else 1


if __name__ == "__main__":
    sys.exit(main())
