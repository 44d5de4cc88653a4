#!/usr/bin/env bash
# Plain decoding through `dspark serve` with the engine core in its own process and as a thread of the server,
# the same load against each, alternated ROUNDS times (default 2) in one run:
#
#   bash scripts/engine_process_load.sh [OUT_DIR]        (default OUT_DIR: /tmp/dspark-engine-process-load)
#
# Each server: --target smollm2-135m --drafter none --dtype bfloat16 --threads 1; the load:
# `dspark bench serve --url ... --concurrency 1,16 --num-requests 16 --max-tokens 64 --temperature 0`.
# Prints one line per run (total tokens/s at 1 and 16 clients, from each run's serve_load.json).
set -euo pipefail
OUT=${1:-/tmp/dspark-engine-process-load}
ROUNDS=${ROUNDS:-2}
DSPARK=${DSPARK:-dspark}
mkdir -p "$OUT"
port=18431
for round in $(seq 1 "$ROUNDS"); do
  for mode in --engine-process --no-engine-process; do
    dir="$OUT/$round$mode"
    mkdir -p "$dir"
    $DSPARK --threads 1 serve --target smollm2-135m --drafter none --dtype bfloat16 --port $port \
      --max-batch 16 --log-level warning "$mode" > "$dir/serve.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
      kill -0 $pid 2> /dev/null || { cat "$dir/serve.log"; exit 1; }
      sleep 1
    done
    $DSPARK bench serve --url "http://127.0.0.1:$port" --concurrency 1,16 --num-requests 16 --max-tokens 64 \
      --temperature 0 --out-dir "$dir" > "$dir/bench.log" 2>&1
    kill -TERM $pid
    wait $pid || true
    python3 - "$dir/serve_load.json" "$round" "$mode" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
rate = {r["concurrency"]: r["total_tokens_per_s"] for r in rows}
print(f"round {sys.argv[2]} {sys.argv[3]:20s} total tok/s: 1 client {rate.get(1, float('nan')):.1f}, "
      f"16 clients {rate.get(16, float('nan')):.1f}")
EOF
  done
done
