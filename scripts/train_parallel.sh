#!/usr/bin/env bash
# Both cores for drafter training: one process with two threads against two DDP processes (torchrun, gloo, one
# thread each), the same global batch (4 sequences: grad_accum 4 against 2 x 2), the same cache and steps; and one
# process with one thread for reference. Prints each run's tokens/s from its train_summary.json
# (docs/reports/training-scale.md §Both cores). Run it on a quiet machine: the ratio is what to read.
#   bash scripts/train_parallel.sh              # R=runs/scale STEPS=30
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
R=${R:-runs/scale}
STEPS=${STEPS:-30}
OUT=${OUT:-$R/train-parallel}
rm -rf "$OUT"
common=(--config smollm2-dspark-markov --set "data=$R/tok-label-1k" --set "cache_dir=$R/features-A"
        --set feature_source=cache --set max_length=1024 --set dtype=bfloat16 --set draft_vocab_size=8192
        --set model.draft_layer=qwen3 --set max_steps="$STEPS" --set checkpoint_every=100000 --set log_every=5)
$DSPARK --threads 1 train "${common[@]}" --out "$OUT/one-thread" --set grad_accum=4 > "$OUT.one-thread.log" 2>&1
$DSPARK --threads 2 train "${common[@]}" --out "$OUT/two-threads" --set grad_accum=4 > "$OUT.two-threads.log" 2>&1
$TORCHRUN --nproc_per_node 2 -m dspark.cli --threads 1 train "${common[@]}" --out "$OUT/ddp-2x1" --set grad_accum=2 \
  > "$OUT.ddp.log" 2>&1
for run in one-thread two-threads ddp-2x1; do
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(f'{sys.argv[2]:12s} {s[\"tokens_per_s\"]:8.1f} tokens/s  ({s[\"steps\"]} steps, world {s[\"world_size\"]})')" \
    "$OUT/$run/train_summary.json" "$run"
done
