"""N concurrent requests with L-token prompts through the HTTP server: what is admitted, queued or refused, and
how large the KV pool grew against the bound `dspark serve` states at start-up (docs/serving/step-cost.md §Memory).

Starts the server in-process on 127.0.0.1 (the engine as a thread, as `dspark bench serve` does), sends all
``--clients`` requests at once (``/v1/completions`` with token-id prompts, temperature 0) and counts the HTTP
statuses; then reads the target's KV pool. ``--target tiny`` is `dspark bench chaos`'s random 2-layer decoder
with SmolLM2's vocabulary and tokenizer (``--context`` positions); any preset or HF folder works too.

    .venv/bin/python scripts/kv_admission.py --target tiny --context 2112 --clients 64 --prompt-tokens 2048 \\
        --max-tokens 8 --max-batch 8 --max-queue 56 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=2112, help="--target tiny only: its context")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=56)
    p.add_argument("--kv-reserve", type=int, default=None, help="as `dspark serve`'s (default: its default)")
    p.add_argument("--prefix-cache", type=int, default=None, help="as `dspark serve`'s (default: --max-batch)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)

    import httpx
    import torch

    from dspark.bench.chaos import _tiny_target
    from dspark.serving.cli import kv_cache_line, kv_settings
    from dspark.serving.engine import Engine, EngineConfig, kv_cache_bound
    from dspark.serving.server import ServerConfig, ServerThread, create_app
    from dspark.target.loading import torch_dtype
    from dspark.target.model import load_target

    torch.set_num_threads(args.threads)
    if args.target == "tiny":
        target = _tiny_target(args.context)
        target.model.to(torch_dtype(args.dtype))
    else:
        target = load_target(args.target, dtype=torch_dtype(args.dtype), fuse=True, pack=True)
    kv = kv_settings(args, target)  # `dspark serve`'s defaults unless given
    print(kv_cache_line(target.kv_bytes_per_token, args.max_batch, target.max_context, **kv), flush=True)
    engine = Engine(target, None, None, EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue, **kv))
    app = create_app(engine, target.tokenizer, ServerConfig(model_name="m"))
    vocab = target.vocab_size

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        prompt = [100 + (i * 7919 + k * 104729) % (vocab - 200) for k in range(args.prompt_tokens)]
        try:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "temperature": 0,
                                                           "max_tokens": args.max_tokens})
        except httpx.HTTPError as err:
            return -1, type(err).__name__
        body = r.json()
        return r.status_code, body.get("error", {}).get("message", "") if r.status_code != 200 else \
            body["choices"][0]["finish_reason"]

    async def run(url: str) -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(args.clients)))

    server = ServerThread(app).start(timeout=900)  # the engine zeroes its KV cache as it starts: GiB at 64 slots
    try:
        results = asyncio.run(run(server.url))
        health = httpx.get(f"{server.url}/health").status_code
    finally:
        server.stop()
    statuses = collections.Counter(code for code, _ in results)
    messages = sorted({msg for code, msg in results if code != 200})
    pool = target.model.kv_pool
    pool_bytes = pool.num_slots * pool.capacity * pool.bytes_per_token
    bound = kv_cache_bound(target.kv_bytes_per_token, args.max_batch, target.max_context, kv["prefix_cache"])
    result = {
        "command": "python scripts/kv_admission.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "statuses": {str(k): v for k, v in sorted(statuses.items())}, "refusals": messages,
        "health_after": health, "kv_bytes_per_token": target.kv_bytes_per_token,
        **kv, "pool_slots": pool.num_slots, "pool_capacity": pool.capacity, "pool_bytes": pool_bytes,
        "bound_bytes": bound,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "load_average": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0 if set(statuses) <= {200, 429} and health == 200 and pool_bytes <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
