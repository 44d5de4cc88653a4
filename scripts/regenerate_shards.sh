#!/usr/bin/env bash
# Answer a prompt file in SHARDS processes, one thread and (where taskset exists) one core each, then merge the
# shards into OUT in the prompts' order: the shard loop scripts/scale_regenerate_archives.sh and
# scripts/scale_t1_answers.sh share.
#
#   DSPARK=.venv/bin/dspark SHARDS=2 bash scripts/regenerate_shards.sh PROMPTS OUT SHARD LOG [regenerate options...]
#
# Shard k answers into SHARD.shardk.jsonl (resumed where it stopped: ids already answered are skipped) and logs to
# LOG.shardk.log; OUT is written through OUT.tmp after every shard has stopped. The options (the sampling) come after
# the stages' fixed ones: bf16, batches of 32, 256 new tokens, seed 21.
set -euo pipefail
[ $# -ge 4 ] || { echo "usage: regenerate_shards.sh PROMPTS OUT SHARD LOG [regenerate options...]"; exit 2; }
DSPARK=${DSPARK:-.venv/bin/dspark}
SHARDS=${SHARDS:-2}
prompts=$1 out=$2 shard=$3 log=$4
shift 4
shards=()
for ((k = 0; k < SHARDS; k++)); do
  shards+=("$shard.shard$k.jsonl")
  pin=()
  command -v taskset > /dev/null && pin=(taskset -c $((k % $(nproc))))
  "${pin[@]}" $DSPARK --threads 1 data regenerate --prompts "$prompts" --out "$shard.shard$k.jsonl" \
    --dtype bfloat16 --batch-size 32 --max-new-tokens 256 --seed 21 "$@" --shard "$k/$SHARDS" \
    > "$log.shard$k.log" 2>&1 &
done
wait
$DSPARK data merge --prompts "$prompts" --out "$out.tmp" "${shards[@]}"
mv "$out.tmp" "$out"
