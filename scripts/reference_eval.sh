#!/usr/bin/env bash
# Evaluate a candidate reference drafter and write docs/reports/results.md (paper Table 1 at T=0 and T=1, per-position
# curves, calibration): the candidate DSpark against the shipped drafter, its DFlash twin (the same data and
# steps), prompt lookup and hybrid drafting. All 8 sets, 10 prompts each (80 in all), 128 new tokens, bf16, every
# draft verified, 95 % bootstrap intervals over prompts and paired differences against the candidate (the first
# drafter of each run). Run after scripts/scale_train.sh (docs/reports/training-scale.md).
#
#   bash scripts/reference_eval.sh                         # CAND=runs/scale/train/dspark-all/step_latest
#   CAND=... TWIN=... EVAL=runs/scale/ref-eval bash scripts/reference_eval.sh
#   CAND_NAME=dspark-3500 TWIN_NAME=dflash-3500 ...   # row names (the scaling report pools dspark-N/dflash-N rows)
#   CALIBRATE=shipped ...                               # STS for the shipped drafter instead of the candidate
#   EXTRA="eagle3-eq=runs/scale/train/eagle3-regen-t1mix-R4/step_latest" OUT=docs/reports/results-equal-data.md \
#     FIGURES=equal-data TITLE="..." ...                 # more rows after the twin (their training runs tabled too),
#                                                       # another page and figures folder (the equal-data Table 1)
#
# Every evaluation resumes per sample (an interrupted run goes on); the greedy and the temperature-1 runs go side
# by side, one thread each. BATCH requests per static batch (default 8: acceptance does not depend on it, greedy
# text neither where bf16 batch invariance holds, docs/architecture.md).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${R:-runs/scale}
CAND=${CAND:-$R/train/dspark-all/step_latest}
TWIN=${TWIN:-$R/train/dflash-all/step_latest}
SHIPPED=${SHIPPED:-checkpoints/smollm2-135m-dspark}
EVAL=${EVAL:-$R/ref-eval}
CALIB=${CALIB:-$R/ref-calib}
LIMIT=${LIMIT:-10}
BATCH=${BATCH:-8}
DSPARK=${DSPARK:-.venv/bin/dspark}
COMMON=(--datasets all --limit "$LIMIT" --max-new-tokens 128 --dtype bfloat16 --batch-size "$BATCH" --no-progress)
CAND_NAME=${CAND_NAME:-dspark}
TWIN_NAME=${TWIN_NAME:-dflash}
drafters=(--drafter "$CAND_NAME=$CAND" --drafter "shipped=$SHIPPED")
[ -d "$TWIN" ] && drafters+=(--drafter "$TWIN_NAME=$TWIN")
for extra in ${EXTRA:-}; do drafters+=(--drafter "$extra"); done
drafters+=(--drafter prompt-lookup=prompt-lookup)
# the drafter whose confidence head is calibrated (STS) and evaluated with it: the candidate, or CALIBRATE=shipped
if [ "${CALIBRATE:-candidate}" = shipped ]; then cal_name=shipped cal_spec=$SHIPPED; else cal_name=$CAND_NAME cal_spec=$CAND; fi
train=(--train "$CAND_NAME=$(dirname "$CAND")")
[ -d "$TWIN" ] && train+=(--train "$TWIN_NAME=$(dirname "$TWIN")")
for extra in ${EXTRA:-}; do train+=(--train "${extra%%=*}=$(dirname "${extra#*=}")"); done

one_temperature() {  # T
  $DSPARK --threads 1 eval "${COMMON[@]}" --temperature "$1" --out "$EVAL/t$1" "${drafters[@]}"
  $DSPARK --threads 1 eval "${COMMON[@]}" --temperature "$1" --out "$EVAL/t$1-hybrid" --hybrid \
    --drafter "hybrid=$CAND" --drafter "hybrid-shipped=$SHIPPED"
}
mkdir -p "$EVAL"
one_temperature 0 > "$EVAL.t0.log" 2>&1 &
{
  one_temperature 1
  # STS on held-out rows beyond the evaluation caps, then temperature 1 with it applied
  [ -f "$CALIB/sts.json" ] || $DSPARK --threads 1 calibrate --drafter "$cal_spec" --name "$cal_name" --limit 8 \
    --max-new-tokens 128 --temperature 1 --dtype bfloat16 --batch-size "$BATCH" --no-progress --out "$CALIB"
  $DSPARK --threads 1 eval "${COMMON[@]}" --temperature 1 --out "$EVAL/t1-sts" --drafter "$cal_name=$cal_spec" \
    --sts "$cal_name=$CALIB/sts.json"
} > "$EVAL.t1.log" 2>&1 &
wait
cmd="CAND=$CAND TWIN=$TWIN CAND_NAME=$CAND_NAME TWIN_NAME=$TWIN_NAME EVAL=$EVAL CALIB=$CALIB CALIBRATE=${CALIBRATE:-candidate}"
[ -z "${EXTRA:-}" ] || cmd="$cmd EXTRA=\"$EXTRA\""
[ -z "${OUT:-}" ] || cmd="$cmd OUT=$OUT FIGURES=${FIGURES:-reference} TITLE=\"${TITLE:-}\""
.venv/bin/python scripts/reference_report.py --command "$cmd bash scripts/reference_eval.sh" --eval "$EVAL" --calibration "$CALIB" --sts-eval "$EVAL/t1-sts" \
  "${train[@]}" --out "${OUT:-docs/reports/results.md}" --figures "${FIGURES:-reference}" \
  --title "${TITLE:-Results: the reference drafter against its peers}"
