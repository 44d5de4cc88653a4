"""What the HTTP server costs: the same closed-loop load against the engine in process and through `dspark serve`.

    PYTHONPATH=src python scripts/server_vs_offline.py [--concurrency 1,16] [--num-requests 32] [--max-tokens 64]
        [--rounds 2] [--out docs/serving/server-vs-offline.md]

Plain greedy decoding of SmolLM2-135M in bf16 with one torch thread, C clients each sending its next request when
the previous one is answered, the prompts `dspark bench serve` sends (first turns of the evaluation sets, round
robin, through the chat template):

- ``offline``: an ``Engine`` (the server's engine, continuous batching, max batch C, `dspark serve`'s defaults for the
  prefix cache and the KV cache held from the start) in this process, the clients
  threads calling ``submit(...).result()``: no HTTP, no detokenisation, no event loop;
- ``server``: a `dspark --threads 1 serve --drafter none --max-batch C` subprocess (engine core in its own process,
  the default), the clients `dspark bench serve`'s streaming HTTP clients (``closed_loop``).

Both run the same requests in alternation, ROUNDS times each; a row's number is the median over rounds of total
completion tokens / wall seconds. The ratio server / offline is what issue 21's goal reads ("the server within
10 % of the offline generator's rate at 16 clients"). Writes a Markdown page with the command when --out is given.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_rate(target, prompt_ids: list[list[int]], concurrency: int, num_requests: int, max_tokens: int) -> float:
    from dspark.sampling.processing import SamplingParams
    from dspark.serving.cli import kv_settings
    from dspark.serving.engine import Engine, EngineConfig

    defaults = argparse.Namespace(max_batch=concurrency, prefix_cache=None, kv_reserve=None)  # as `dspark serve`'s
    engine = Engine(target, None, None, EngineConfig(max_batch=concurrency, max_queue=num_requests,
                                                     **kv_settings(defaults, target))).start()
    counter = iter(range(num_requests))
    lock = threading.Lock()
    tokens = [0]

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            ids, _ = engine.submit(prompt_ids[i % len(prompt_ids)], SamplingParams(0.0, max_new_tokens=max_tokens)).result()
            with lock:
                tokens[0] += len(ids)

    try:
        start = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return tokens[0] / (time.perf_counter() - start)
    finally:
        engine.stop()


def server_rate(prompts: list[str], concurrency: int, num_requests: int, max_tokens: int) -> float:
    from dspark.bench.serve_load import closed_loop

    port = _free_port()
    cmd = [sys.executable, "-m", "dspark.cli", "--threads", "1", "serve", "--target", "smollm2-135m", "--drafter",
           "none", "--dtype", "bfloat16", "--max-batch", str(concurrency), "--max-queue", str(num_requests),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"dspark serve stopped: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        asyncio.run(closed_loop(base, prompts[:1], 1, 1, 8, temperature=0.0))  # warm-up
        records, wall = asyncio.run(closed_loop(base, prompts, concurrency, num_requests, max_tokens, temperature=0.0))
        bad = [r.error for r in records if not r.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
        return sum(r.completion_tokens for r in records) / wall
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from dspark.bench.serve_load import load_prompts
    from dspark.tables import markdown_table
    from dspark.target.loading import load_decoding_target

    prompts = load_prompts(None, limit=args.num_requests)
    target = load_decoding_target("smollm2-135m", device="cpu", dtype="bfloat16")
    prompt_ids = [target.encode_chat(text) for text in prompts]
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        got = {"offline": [], "server": []}
        for _ in range(args.rounds):
            got["offline"].append(offline_rate(target, prompt_ids, c, args.num_requests, args.max_tokens))
            got["server"].append(server_rate(prompts, c, args.num_requests, args.max_tokens))
            print(c, {k: f"{v[-1]:.1f}" for k, v in got.items()}, flush=True)
        off, srv = (statistics.median(got[k]) for k in ("offline", "server"))
        rows.append([str(c), f"{off:.1f}", f"{srv:.1f}", f"{srv / off:.2f}"])
    command = "PYTHONPATH=src python scripts/server_vs_offline.py " + " ".join(sys.argv[1:])
    page = "\n".join([
        "# The server against its engine in process",
        "",
        f"Written by `{command.strip()}` (torch {torch.__version__}, one thread, bf16, plain greedy decoding of "
        f"SmolLM2-135M; {args.num_requests} requests of {args.max_tokens} new tokens per point, closed-loop clients, "
        f"median of {args.rounds} rounds, offline and server alternated). `offline`: the serving `Engine` in "
        "process, clients as threads (no HTTP); `server`: `dspark serve` in a subprocess, streaming HTTP clients "
        "(`dspark bench serve`'s); both with `dspark serve`'s defaults (a prefix cache of C prompts, the KV cache "
        "held from the start). Total completion tokens per second.",
        "",
        *markdown_table(["clients", "offline (tok/s)", "server (tok/s)", "server / offline"], rows),
        "",
    ])
    print(page)
    if args.out:
        Path(args.out).write_text(page)


if __name__ == "__main__":
    main()
