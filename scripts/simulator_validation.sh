#!/usr/bin/env bash
# The scheduler simulator against the real engine on this machine (docs/serving/simulator-validation.md):
# this machine's SPS table (`dspark profile`), prompt-lookup acceptance statistics and a length trace
# (`dspark eval`), the real closed-loop load test (`dspark bench serve`), then `dspark simulate` at the same
# loads with `--compare` against the measured rows. Single-threaded and short (about 15 minutes on 2 busy cores).
#   bash scripts/simulator_validation.sh
# Steps already done (their output file exists) are skipped.
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
OUT=${OUT:-runs/simval}
mkdir -p $OUT
MAX_TOKENS=32
NUM_REQUESTS=${NUM_REQUESTS:-16}  # requests per load point, and prompts (the first NUM_REQUESTS of the round-robin mix)
uptime
# one prompt file for the eval (drafter statistics and length trace) and the load test: the first prompt of
# each packaged evaluation set, in the load test's own round-robin order
if [ ! -f $OUT/prompts.jsonl ]; then
  ${PYTHON:-.venv/bin/python} -c "
import json, sys
from dspark.bench.serve_load import load_prompts
for p in load_prompts(None, limit=$NUM_REQUESTS): print(json.dumps({'turns': [p]}))" > $OUT/prompts.jsonl.tmp
  mv $OUT/prompts.jsonl.tmp $OUT/prompts.jsonl
fi
# verify steps: every batch-token count 1..32 (up to 4 requests x 8 tokens); prefill: one request's chunk of 64,
# 128, ..., 512 tokens (the engine feeds at most 256 per iteration)
if [ ! -f $OUT/sps_verify.json ]; then
  $DSPARK --threads 1 profile --block-size 7 --max-requests 4 --context-len 128 --dense --repeats 3 \
    --out $OUT/sps_verify.json
fi
if [ ! -f $OUT/sps_prefill.json ]; then
  $DSPARK --threads 1 profile --prefill --block-size 63 --max-requests 8 --context-len 0 --repeats 3 \
    --out $OUT/sps_prefill.json
fi
if [ ! -f $OUT/eval/results.json ]; then
  $DSPARK --threads 1 eval --drafter pld=prompt-lookup --jsonl val=$OUT/prompts.jsonl --max-new-tokens $MAX_TOKENS \
    --temperature 0 \
    --out $OUT/eval --no-progress
fi
if [ ! -f $OUT/serve/serve_load.json ]; then
  $DSPARK bench serve --drafter prompt-lookup --sps-table $OUT/sps_verify.json --threads 1 \
    --policies fixed:1,alg1,all --concurrency 1,2,4 --num-requests $NUM_REQUESTS --max-tokens $MAX_TOKENS \
    --temperature 0 --prompts $OUT/prompts.jsonl --out-dir $OUT/serve
fi
# the same tables again right after the load test: on a shared machine the step time drifts with the other jobs
if [ ! -f $OUT/sps_verify_after.json ]; then
  uptime
  $DSPARK --threads 1 profile --block-size 7 --max-requests 4 --context-len 128 --dense --repeats 3 \
    --out $OUT/sps_verify_after.json
  $DSPARK --threads 1 profile --prefill --block-size 63 --max-requests 8 --context-len 0 --repeats 3 \
    --out $OUT/sps_prefill_after.json
  uptime
fi
# simulated with the tables profiled before and after the load test, and with the tables the load test itself
# observed (bench serve's observed_*_sps.json: 1 / median seconds of the engine's own steps and prefill chunks at
# each batch-token count, so the machine's load during the run is in the timing); alg1 plans on the table its
# server was given (--policy-sps-table) in every variant. Request i of the simulation drafts as eval record i did
# (--per-request-stats): the same prompt as the load test's request i, decoded greedily, so the same proposals
for tag in "" _after _observed; do
  if [ "$tag" = _observed ]; then
    verify=$OUT/serve/observed_verify_sps.json prefill=$OUT/serve/observed_prefill_sps.json
  else
    verify=$OUT/sps_verify$tag.json prefill=$OUT/sps_prefill$tag.json
  fi
  $DSPARK --threads 1 simulate --sps-table $verify --prefill-sps-table $prefill \
    --policy-sps-table $OUT/sps_verify.json \
    --per-request-stats --drafter-name pld --trace $OUT/eval/samples.jsonl --users 1,2,4 \
    --num-requests $NUM_REQUESTS --policies fixed:1,alg1,all --compare $OUT/serve/serve_load.json --out-dir $OUT/sim$tag
done
uptime
