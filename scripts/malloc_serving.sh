#!/usr/bin/env bash
# What glibc's fixed mmap/trim thresholds cost a server (docs/serving/malloc.md): `dspark serve --drafter none`
# under the same load twice in one run, with the thresholds fixed at 256 KiB / 512 KiB (the `--malloc-tuning`
# default before: MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment, which `tune_malloc` keeps)
# and with glibc's dynamic thresholds (today's default), then `--no-malloc-tuning` (glibc's and oneDNN's defaults).
#
#   bash scripts/malloc_serving.sh          # CONCURRENCY=1,16 NUM_REQUESTS=32 MAX_TOKENS=64 PORT=8031
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-$HOME/.cache/dspark/models/smollm2-135m}
CONCURRENCY=${CONCURRENCY:-1,16}
NUM_REQUESTS=${NUM_REQUESTS:-32}
MAX_TOKENS=${MAX_TOKENS:-64}
PORT=${PORT:-8031}
WORK=${WORK:-runs/malloc}
OUT=${OUT:-docs/serving/malloc.md}
MAXC=$(tr ',' '\n' <<<"$CONCURRENCY" | sort -n | tail -1)
mkdir -p "$WORK"
server=
stop() { [ -n "$server" ] && { kill -TERM -- "-$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; server=; }; }
trap stop EXIT

row() {  # name, env..., --, serve flags...
  local name=$1; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  env ${envs[@]+"${envs[@]}"} PYTHONPATH="$PWD/src" setsid "$PY" -m dspark.cli --threads 1 serve --target "$MODEL" \
    --served-model-name smollm2-135m --dtype bfloat16 --max-batch "$MAXC" --max-queue "$((4 * MAXC))" \
    --host 127.0.0.1 --port "$PORT" --log-level warning --drafter none "$@" > "$WORK/$name.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  PYTHONPATH="$PWD/src" "$PY" -m dspark.cli --threads 1 bench serve --url "http://127.0.0.1:$PORT" \
    --concurrency "$CONCURRENCY" --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --temperature 0 \
    --out-dir "$WORK/$name" > "$WORK/$name.bench.log" 2>&1
  stop
}
row fixed MALLOC_MMAP_THRESHOLD_=262144 MALLOC_TRIM_THRESHOLD_=524288 --
row dynamic --
row none -- --no-malloc-tuning

PYTHONPATH="$PWD/src" "$PY" - "$WORK" "$OUT" "$CONCURRENCY $NUM_REQUESTS $MAX_TOKENS" <<'PYEOF'
import json, sys, os
work, out, (conc, num, mt) = sys.argv[1], sys.argv[2], sys.argv[3].split()
names = {"fixed": "--malloc-tuning, thresholds fixed at 256 / 512 KiB (the earlier default)",
         "dynamic": "--malloc-tuning, glibc's dynamic thresholds (the default now)",
         "none": "--no-malloc-tuning (glibc's and oneDNN's defaults)"}
rows = {n: {r["concurrency"]: r for r in json.load(open(f"{work}/{n}/serve_load.json"))["rows"]} for n in names}
load = os.getloadavg()[0]
lines = ["# What fixed malloc thresholds cost the server", "",
         "Written by `bash scripts/malloc_serving.sh` (one run, nothing else running; 1-minute load average at the "
         f"end {load:.2f}). `dspark --threads 1 serve --drafter none --dtype bfloat16` of SmolLM2-135M, each setting "
         f"its own server, the same load: `dspark bench serve --concurrency {conc} --num-requests {num} "
         f"--max-tokens {mt} --temperature 0`. Ratios are against the first row at the same clients.", "",
         "| setting | clients | total tok/s | vs fixed | per-user tok/s |", "|---|---:|---:|---:|---:|"]
for n, label in names.items():
    for c, r in sorted(rows[n].items()):
        base = rows["fixed"][c]["total_tokens_per_s"]
        lines.append(f"| {label} | {c} | {r['total_tokens_per_s']:.1f} | {r['total_tokens_per_s'] / base:.2f}x | "
                     f"{r['user_tokens_per_s']:.1f} |")
lines += ["", "With the thresholds fixed low, every tensor of 256 KiB or more (a prefill chunk's activations, the "
          "attention blocks of a batch) is mmapped, page-faulted in and unmapped again at each step; glibc's "
          "dynamic threshold rises to the sizes the engine frees and serves them from the heap. The arena cap, "
          "`malloc_trim` every 64 requests and the kernel-cache caps stay (docs/reports/reliability.md, Memory)."]
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
