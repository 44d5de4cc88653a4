#!/usr/bin/env bash
# The scheduler simulator against the real engine on this machine (docs/serving/simulator-validation.md):
# this machine's SPS table (`dspark profile`), prompt-lookup acceptance statistics and a length trace
# (`dspark eval`), the real closed-loop load test (`dspark bench serve`), then `dspark simulate` at the same
# loads with `--compare` against the measured rows. Single-threaded and short (about 15 minutes on 2 busy cores).
#   bash bench/simulator_validation.sh
# Steps already done (their output file exists) are skipped.
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
OUT=runs/simval
mkdir -p $OUT
MAX_TOKENS=32
# verify steps: every batch-token count 1..32 (up to 4 requests x 8 tokens); prefill: multiples of 64 up to 512
if [ ! -f $OUT/sps_verify.json ]; then
  $DSPARK --threads 1 profile --block-size 7 --max-requests 4 --context-len 128 --dense --repeats 3 \
    --out $OUT/sps_verify.json
fi
if [ ! -f $OUT/sps_prefill.json ]; then
  $DSPARK --threads 1 profile --block-size 63 --max-requests 8 --context-len 64 --repeats 3 \
    --out $OUT/sps_prefill.json
fi
if [ ! -f $OUT/eval/results.json ]; then
  $DSPARK --threads 1 eval --drafter pld=prompt-lookup --datasets all --limit 2 --max-new-tokens $MAX_TOKENS \
    --out $OUT/eval --no-progress
fi
if [ ! -f $OUT/serve/serve_load.json ]; then
  $DSPARK bench serve --drafter prompt-lookup --sps-table $OUT/sps_verify.json --threads 1 \
    --policies fixed:1,alg1,all --concurrency 1,2,4 --num-requests 4 --max-tokens $MAX_TOKENS --out-dir $OUT/serve
fi
# the same tables again right after the load test: on a shared machine the step time drifts with the other jobs
if [ ! -f $OUT/sps_verify_after.json ]; then
  uptime
  $DSPARK --threads 1 profile --block-size 7 --max-requests 4 --context-len 128 --dense --repeats 3 \
    --out $OUT/sps_verify_after.json
  $DSPARK --threads 1 profile --block-size 63 --max-requests 4 --context-len 64 --repeats 3 \
    --out $OUT/sps_prefill_after.json
  uptime
fi
for tag in "" _after; do
  $DSPARK --threads 1 simulate --sps-table $OUT/sps_verify$tag.json --prefill-sps-table $OUT/sps_prefill$tag.json \
    --stats $OUT/eval/results.json --drafter-name pld --trace $OUT/eval/samples.jsonl --users 1,2,4 \
    --num-requests 4 --policies fixed:1,alg1,all --compare $OUT/serve/serve_load.json --out-dir $OUT/sim$tag
done
