#!/usr/bin/env bash
# Where the serving engine's time goes under load: `dspark serve` with POLICY, a closed-loop load of CLIENTS
# clients (`dspark bench serve`), and py-spy sampling the engine core process for DURATION seconds in the middle of
# it; the functions with the most samples (scripts/collapsed_stacks.py) go to OUT/profile.md, with the share of the
# engine's steps that carry prompt pieces and of the drafter's proposals.
#
#   PY_SPY=/path/to/py-spy bash scripts/serve_profile.sh                 # async, 16 clients, 96 requests
#   POLICY=fixed:1 CLIENTS=4 OUT=runs/serve-profile-f1 bash scripts/serve_profile.sh
#
# py-spy is not a dependency of the project: `python3 -m venv /tmp/spy && /tmp/spy/bin/pip install py-spy`, then
# PY_SPY=/tmp/spy/bin/py-spy. Timings: run it alone on the machine (py-spy samples from outside the process, at
# RATE samples/s, and slows it little).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PY_SPY=${PY_SPY:-py-spy}
POLICY=${POLICY:-async}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-dspark}
CLIENTS=${CLIENTS:-16}
NUM_REQUESTS=${NUM_REQUESTS:-96}
MAX_TOKENS=${MAX_TOKENS:-64}
DURATION=${DURATION:-20}
RATE=${RATE:-200}
PORT=${PORT:-8031}
OUT=${OUT:-runs/serve-profile}
MODEL=${MODEL:-smollm2-135m}
command -v "$PY_SPY" >/dev/null || { echo "no py-spy at '$PY_SPY' (PY_SPY=...; see the header)"; exit 2; }
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && { echo "something already answers on port $PORT; PORT=..."; exit 2; }
mkdir -p "$OUT"
sts=()
[ "$DRAFTER" != none ] && [ -f "$DRAFTER/sts.json" ] && sts=(--sts "$DRAFTER/sts.json")
PYTHONPATH="$PWD/src" setsid "$PY" -m dspark.cli --threads 1 serve --target "$MODEL" --dtype bfloat16 \
  --max-batch "$CLIENTS" --host 127.0.0.1 --port "$PORT" --log-level warning --drafter "$DRAFTER" "${sts[@]}" \
  --policy "$POLICY" > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT  # gone before the next run
for _ in $(seq 150); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$server" 2>/dev/null || { echo "the server exited; see $OUT/server.log"; exit 1; }
  sleep 2
done
core=$(grep -o 'engine core in process [0-9]*' "$OUT/server.log" | grep -o '[0-9]*$' || true)
[ -n "$core" ] || { echo "no engine core pid in $OUT/server.log"; exit 1; }
PYTHONPATH="$PWD/src" "$PY" -m dspark.cli --threads 1 bench serve --url "http://127.0.0.1:$PORT" \
  --concurrency "$CLIENTS" --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --temperature 0 \
  --out-dir "$OUT/load" > "$OUT/load.log" 2>&1 &
load=$!
sleep 5  # past the first prefills
"$PY_SPY" record --pid "$core" --duration "$DURATION" --rate "$RATE" --format raw --output "$OUT/stacks.txt" \
  --nonblocking > "$OUT/py-spy.log" 2>&1
wait $load
mixed=$(grep -n 'self._step(with_prefill=True)' src/dspark/serving/engine.py | cut -d: -f1)  # the mixed steps' call
[ -n "$mixed" ] || { echo "no mixed-step call in src/dspark/serving/engine.py: update this script"; exit 1; }
drafter=""
[ "$DRAFTER" = checkpoints/smollm2-135m-dspark ] || drafter="DRAFTER=$DRAFTER "
[ -z "${DSPARK_PROMPT_ATTENTION:-}" ] || drafter="DSPARK_PROMPT_ATTENTION=$DSPARK_PROMPT_ATTENTION $drafter"
"$PY" scripts/collapsed_stacks.py "$OUT/stacks.txt" --under "engine.py:$mixed" --under DSparkDrafter.propose \
  --title "Written by \`${drafter}POLICY=$POLICY CLIENTS=$CLIENTS NUM_REQUESTS=$NUM_REQUESTS MAX_TOKENS=$MAX_TOKENS \
bash scripts/serve_profile.sh\` (py-spy on the engine core for $DURATION s, $RATE samples/s)." | tee "$OUT/profile.md"
