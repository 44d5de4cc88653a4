#!/usr/bin/env bash
# Runs every command of docs/guide/own-model.md at toy sizes (minutes on a CPU) in a scratch folder, to check
# that the page's commands and flags work: bash scripts/guide_own_model.sh [MODEL] [WORKDIR]
# MODEL defaults to the SmolLM2 folder `dspark prepare` writes. The exports of a non-Qwen3 model are expected
# to be refused (exit status 2, one line naming the reason), as the page says; serve is started, asked for
# /v1/models and stopped. DSPARK (default: .venv/bin/dspark) is the command to run.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DSPARK=${DSPARK:-$REPO/.venv/bin/dspark}
D="$DSPARK --threads 1"
MODEL=${1:-${DSPARK_HOME:-$HOME/.cache/dspark}/models/smollm2-135m}
WORK=${2:-$(mktemp -d)}
mkdir -p "$WORK" && cd "$WORK"
echo "[guide] MODEL=$MODEL in $WORK"
$D prepare --target "$MODEL"
$D generate --target "$MODEL" --chat "Write a prime sieve in Python." --drafter prompt-lookup --compare-plain --max-new-tokens 32
$D data prompts --out data/prompts.jsonl --num 12
$D data regenerate --target "$MODEL" --prompts data/prompts.jsonl --out data/regenerated.jsonl --max-new-tokens 48
$D data tokenize --in data/regenerated.jsonl --target "$MODEL" --out data/tok --max-length 256
$D data vocab --data data/tok --size 1024 --target "$MODEL" --out data/draft-vocab.json
$D train --config smollm2-dspark-markov --set target="$MODEL" --set data=data/tok --out runs/mine \
  --set max_steps=4 --set grad_accum=1 --set draft_vocab_size=null --set checkpoint_every=2
$D calibrate --target "$MODEL" --drafter runs/mine/step_latest --datasets gsm8k,mbpp --limit 2 --max-new-tokens 32 --out runs/calib
$D eval --target "$MODEL" --drafter mine=runs/mine/step_latest --drafter lookup=prompt-lookup \
  --datasets gsm8k,humaneval --limit 1 --temperature 0 --max-new-tokens 32 --sts mine=runs/calib/sts.json --out runs/eval
$D profile --target "$MODEL" --block-size 7 --max-requests 2 --repeats 1 --out sps.json
$D serve --target "$MODEL" --drafter runs/mine/step_latest --policy alg1 --sps-table sps.json \
  --sts runs/calib/sts.json --port 8765 --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  if curl -sf http://127.0.0.1:8765/v1/models >/dev/null 2>&1; then break; fi
  sleep 1
done
curl -sf http://127.0.0.1:8765/v1/models
echo
kill $SERVER; wait $SERVER || true
trap - EXIT
for engine in sglang vllm; do
  extra=(); [ $engine = sglang ] && extra=(--sps-table sps.json --sts runs/calib/sts.json)
  set +e
  $D export --to $engine runs/mine/step_latest out/mine-$engine --target "$MODEL" "${extra[@]}"
  status=$?
  set -e
  echo "[guide] export --to $engine: exit status $status"
done
echo "[guide] every command of docs/guide/own-model.md ran"
