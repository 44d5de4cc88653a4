#!/usr/bin/env bash
# Evaluate the reference drafter and write docs/results.md (paper Table 1 at T=0 and T=1, per-position curves,
# calibration). Run after scripts/reference_drafter.sh (and, for the stage-2 rows, scripts/data_mix.sh).
#
#   bash scripts/reference_eval.sh [RUN] [EVAL]        # defaults: runs/ref runs/ref-eval
#
# Every step is skipped when its output exists, so an interrupted run resumes. One thread per step, float32
# (the evaluations are acceptance statistics, not timings). About 50 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/ref}
EVAL=${2:-runs/ref-eval}
CALIB=${CALIB:-runs/ref-calib}
DSPARK=${DSPARK:-.venv/bin/dspark}
REF=checkpoints/smollm2-135m-dspark
# DFlash at DSpark's step count rounded down to the checkpoint interval (the same data and steps)
DFLASH=${DFLASH:-$RUN/dflash/step_3000}
COMMON=(--datasets all --limit 2 --max-new-tokens 128)

for T in 0 1; do
  [ -f "$EVAL/t$T/results.json" ] || $DSPARK --threads 1 eval "${COMMON[@]}" --temperature $T --out "$EVAL/t$T" \
    --drafter dspark=$REF --drafter dflash="$DFLASH" --drafter prompt-lookup=prompt-lookup
  [ -f "$EVAL/t$T-hybrid/results.json" ] || $DSPARK --threads 1 eval "${COMMON[@]}" --temperature $T \
    --out "$EVAL/t$T-hybrid" --hybrid --drafter hybrid=$REF
done
# STS on held-out rows beyond the evaluation caps, then the temperature-1 evaluation with it applied
[ -f "$CALIB/sts.json" ] || $DSPARK --threads 1 calibrate --drafter $REF --name dspark --limit 8 \
  --max-new-tokens 128 --temperature 1 --out "$CALIB"
[ -f "$EVAL/t1-sts/results.json" ] || $DSPARK --threads 1 eval "${COMMON[@]}" --temperature 1 \
  --out "$EVAL/t1-sts" --drafter dspark=$REF --sts dspark="$CALIB/sts.json"

MIX=()
[ -d runs/data-mix-eval ] && MIX+=(--data-mix runs/data-mix-eval)
[ -d runs/data-mix-eval-t1 ] && MIX+=(--data-mix-t1 runs/data-mix-eval-t1)
.venv/bin/python scripts/reference_report.py --run "$RUN" --eval "$EVAL" "${MIX[@]}" --calibration "$CALIB" \
  --sts-eval "$EVAL/t1-sts" --out docs/results.md
