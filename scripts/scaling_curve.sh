#!/usr/bin/env bash
# The scaling curve of docs/reports/training-scale.md: every point of scripts/scale_train.sh whose DSpark and DFlash runs
# have finished is evaluated greedily (10 prompts per benchmark, 128 new tokens, bf16, BATCH requests per static
# batch; one eval folder, resumed per sample), then scripts/scaling_report.py writes the table and
# docs/reports/figures/scaling.png from the samples of that folder and of the POOL folders (earlier greedy evaluations with
# the same prompts and seed, e.g. scripts/reference_eval.sh's t0 or a batch-1 run: a point found there is not
# evaluated again).
#   bash scripts/scale_data.sh && bash scripts/scale_train.sh && bash scripts/scaling_curve.sh
#   POOL="runs/scale/eval-greedy runs/scale/ref-eval-3500/t0" bash scripts/scaling_curve.sh
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${R:-runs/scale}
BATCH=${BATCH:-8}
EVAL=${EVAL:-$R/eval-greedy-b$BATCH}
POOL=${POOL:-$R/eval-greedy}
done_run() { [ -f "$1/train_summary.json" ] && grep -q '"stopped_by": "max_steps"' "$1/train_summary.json"; }
pooled() { for f in $POOL; do grep -qs "\"drafter\": \"$1\"" "$f/samples.jsonl" && return 0; done; return 1; }
for p in 330 1000 3500 all; do
  a="$R/train/dspark-$p" b="$R/train/dflash-$p"
  done_run "$a" && done_run "$b" || continue
  pooled "dspark-$p" && pooled "dflash-$p" && continue
  $DSPARK --threads 1 eval --datasets all --limit 10 --max-new-tokens 128 --temperature 0 --dtype bfloat16 \
    --batch-size "$BATCH" --no-progress --out "$EVAL" --drafter "dspark-$p=$a/step_latest" --drafter "dflash-$p=$b/step_latest"
done
evals=()
for f in $POOL "$EVAL"; do [ -f "$f/samples.jsonl" ] && evals+=(--eval "$f"); done
.venv/bin/python scripts/scaling_report.py "${evals[@]}" --tok "$R/tok-label-1k" --train "$R/train" \
  --out docs/reports/training-scale.md --figure docs/reports/figures/scaling.png
