#!/usr/bin/env bash
# What a longer training budget does: DSpark (Markov head) trained for BUDGET seconds in bf16 on one thread on the
# study's feature cache (6.6x the main study's tokens at the default), then DFlash for the same number of optimizer
# steps (same sequences seen), evaluated exactly as docs/reports/results-study.md (all 8 sets, 2 samples each, 128 tokens,
# temperature 1.0) next to the study's own DSpark drafter.
# Writes docs/reports/long-training.md. Steps already done (train_summary.json, results.json) are skipped.
#   bash scripts/long_training.sh [BUDGET_SECONDS]     (needs runs/study from `dspark reproduce --budget cpu`)
set -euo pipefail
BUDGET=${1:-2700}
DSPARK=${DSPARK:-.venv/bin/dspark}
RUN=runs/study/train-long/dspark-markov
DFLASH=runs/study/train-long/dflash
EVAL=runs/study/eval-long
common=(--set data=runs/study/tok --set feature_source=cache --set cache_dir=runs/study/data/features
        --set max_length=512 --set num_threads=1 --set dtype=bfloat16)
if [ ! -f $RUN/train_summary.json ]; then
  $DSPARK train --config smollm2-dspark-markov --drafter dspark --out $RUN --resume "${common[@]}" \
    --set epochs=10 --set time_budget_s=$BUDGET
fi
STEPS=$(.venv/bin/python -c "import json; print(json.load(open('$RUN/train_summary.json'))['steps'])")
if [ ! -f $DFLASH/train_summary.json ]; then
  $DSPARK train --config smollm2-dflash --drafter dflash --out $DFLASH --resume "${common[@]}" --set max_steps=$STEPS
fi
if ! grep -q dflash-long $EVAL/results.json 2>/dev/null; then  # resumable: finished samples are kept
  $DSPARK --threads 1 eval --datasets all --limit 2 --max-new-tokens 128 --out $EVAL --no-progress \
    --drafter dspark-markov-long=$RUN/step_latest --drafter dspark-markov=runs/study/train/dspark-markov/step_latest \
    --drafter dflash-long=$DFLASH/step_latest
fi
# the page's text stays; the tables between its markers are rewritten from the runs
.venv/bin/python - "$RUN" "$DFLASH" "$EVAL" "$BUDGET" "$STEPS" <<'EOF'
import sys

from dspark.studies.long_training import write_long_training_tables

run, dflash, eval_dir, budget, steps = sys.argv[1:]
print("wrote", write_long_training_tables("docs/reports/long-training.md", [
    ("dspark-markov", "runs/study/train/dspark-markov", "540 s, float32, 2 threads (`dspark reproduce --budget cpu`)"),
    ("dspark-markov-long", run, f"{budget} s, bfloat16, 1 thread (this script)"),
    ("dflash-long", dflash, f"{steps} steps like dspark-markov-long, bfloat16, 1 thread")], eval_dir))
EOF
