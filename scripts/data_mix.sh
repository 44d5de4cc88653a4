#!/usr/bin/env bash
# Which training data buys the better drafter per CPU-hour: more regenerated answers, or teacher-forced labelled
# text (docs/reports/data-throughput.md §Which data per CPU-hour). Both arms start from the reference drafter's stage-1
# weights (scripts/reference_drafter.sh) and train for the same seconds on one thread each, side by side, on stage 1's
# feature cache plus
#   regen: the answers to the next prompts (stage 2's features2; stage 2 of scripts/reference_drafter.sh is this arm)
#   label: LABEL_NUM records of `dspark data label` (about as many supervised tokens)
# then both are evaluated as the reference drafter is (8 sets x 2 prompts, 128 new tokens, greedy and temperature 1,
# one thread).
# Every step resumes. Needs stage 1 and stage 2's data (features2) of scripts/reference_drafter.sh first.
#   bash scripts/data_mix.sh            # RUN=runs/ref TRAIN_S=2400 LABEL_NUM=700
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${RUN:-runs/ref}
TRAIN_S=${TRAIN_S:-2400}
LABEL_NUM=${LABEL_NUM:-700}
EVAL=${EVAL:-runs/data-mix-eval}      # greedy
EVAL1=${EVAL1:-runs/data-mix-eval-t1}  # temperature 1
D="$DSPARK --threads 1"
[ -f "$R/labelled.jsonl" ] || $D data label --out "$R/labelled.jsonl" --num "$LABEL_NUM" --seed 11 \
  --max-answer-chars 1500
[ -f "$R/tok-label/manifest.json" ] || $D data tokenize --in "$R/labelled.jsonl" --target smollm2-135m \
  --out "$R/tok-label" --max-length 512
[ -f "$R/features-label/DONE" ] || { $D data features --config smollm2-dspark-markov --data "$R/tok-label" \
  --out "$R/features-label" --max-length 512 && touch "$R/features-label/DONE"; }
common=(--init-from "$R/dspark/step_latest" --set feature_source=cache --set max_length=512 --set dtype=bfloat16
        --set epochs=200 --set "time_budget_s=$TRAIN_S" --set checkpoint_every=100 --set keep_checkpoints=100)
$D train --config smollm2-dspark-markov --drafter dspark --out "$R/dspark2" --resume "${common[@]}" \
  --set "cache_dir=[\"$R/features\", \"$R/features2\"]" &
$D train --config smollm2-dspark-markov --drafter dspark --out "$R/dspark-label" --resume "${common[@]}" \
  --set "cache_dir=[\"$R/features\", \"$R/features-label\"]" &
wait
$D eval --datasets all --limit 2 --max-new-tokens 128 --temperature 0 --out "$EVAL/regen" --no-progress \
  --drafter "regen=$R/dspark2/step_latest" &
$D eval --datasets all --limit 2 --max-new-tokens 128 --temperature 0 --out "$EVAL/label" --no-progress \
  --drafter "label=$R/dspark-label/step_latest" &
wait
for arm in regen label; do
  spec=$([ $arm = regen ] && echo "$R/dspark2/step_latest" || echo "$R/dspark-label/step_latest")
  $D eval --datasets all --limit 2 --max-new-tokens 128 --temperature 1 --out "$EVAL1/$arm" --no-progress \
    --drafter "$arm=$spec" &
done
wait
