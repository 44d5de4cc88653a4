#!/usr/bin/env bash
# The scaling curve of docs/training-scale.md: every point of scripts/scale_train.sh whose DSpark and DFlash runs
# have finished is evaluated greedily (10 prompts per benchmark, 128 new tokens, bf16; one eval folder, resumed
# per sample), then scripts/scaling_report.py writes the table and docs/figures/scaling.png.
#   bash scripts/scale_data.sh && bash scripts/scale_train.sh && bash scripts/scaling_curve.sh
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${R:-runs/scale}
EVAL=${EVAL:-$R/eval-greedy}
done_run() { [ -f "$1/train_summary.json" ] && grep -q '"stopped_by": "max_steps"' "$1/train_summary.json"; }
for p in 330 1000 3500 all; do
  a="$R/train/dspark-$p" b="$R/train/dflash-$p"
  done_run "$a" && done_run "$b" || continue
  $DSPARK --threads 1 eval --datasets all --limit 10 --max-new-tokens 128 --temperature 0 --dtype bfloat16 \
    --no-progress --out "$EVAL" --drafter "dspark-$p=$a/step_latest" --drafter "dflash-$p=$b/step_latest"
done
.venv/bin/python scripts/scaling_report.py --eval "$EVAL" --tok "$R/tok-label-1k" --train "$R/train" \
  --out docs/training-scale.md --figure docs/figures/scaling.png
