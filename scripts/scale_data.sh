#!/usr/bin/env bash
# The training set of the drafter-at-scale run (docs/reports/training-scale.md): teacher-forced labelled text from the offline
# sources (`dspark data label`), tokenized at 1,024 tokens, and the target's features cached in three slices so
# that the first ones are usable (and the scaling curve's small points are prefixes) while the rest is built:
#   A = sequences [0, 1000)  (~0.3 M tokens)   B = [1000, 3500) (~1.1 M in all)   C = [3500, end) (~4.2 M in all)
# Each slice is labelled by two processes (torchrun, one thread each) in bfloat16. Every step resumes: rerun the
# same command after an interruption (a slice resumes with the same number of processes).
#   bash scripts/scale_data.sh              # R=runs/scale NUM=16000 PROCS=2
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
R=${R:-runs/scale}
NUM=${NUM:-16000}
PROCS=${PROCS:-2}
mkdir -p "$R"
[ -f "$R/labelled.jsonl" ] || $DSPARK --threads 1 data label --out "$R/labelled.jsonl" --num "$NUM" --seed 20 --allow-short
[ -f "$R/tok-label-1k/manifest.json" ] || $DSPARK --threads 1 data tokenize --in "$R/labelled.jsonl" \
  --target smollm2-135m --out "$R/tok-label-1k" --max-length 1024
slice() {  # name start [limit]
  local out="$R/features-$1"
  [ -f "$out/manifest.json" ] && return 0
  $TORCHRUN --nproc_per_node "$PROCS" -m dspark.cli --threads 1 data features --config smollm2-dspark-markov \
    --dtype bfloat16 --data "$R/tok-label-1k" --out "$out" --max-length 1024 --skip "$2" ${3:+--limit "$3"}
}
slice A 0 1000
slice B 1000 2500
slice C 3500
