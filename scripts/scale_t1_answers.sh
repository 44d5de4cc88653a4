#!/usr/bin/env bash
# Temperature-1 answers to prompts already answered
# (docs/reports/training-scale.md §Temperature-1 answers to slice R4's prompts): the prompts of one committed slice
# of regenerated-R.jsonl (SLICE, default R4) answered again by plain sampling at temperature 1 (no top-p, no top-k:
# the samples the temperature-1 evaluation draws), then tokenized and cached as the training slice T1<SLICE>
# (features-T1R4 for R4). The same prompts at two samplings: a warm start on the slice tells whether contexts sampled
# at temperature 1 lift the temperature-1 acceptance, without the hours of self-written prompts stage 8 needs on a
# fresh machine (its prompts exclude stages 3-7's).
#
#   bash scripts/scale_t1_answers.sh                 # R=runs/scale SLICE=R4 SHARDS=2 PROCS=2 (both cores)
#   NUM=3000 bash scripts/scale_t1_answers.sh        # the slice's first NUM prompts only
#   NAME=dspark2-t1 SLICES="T1R4" PROCS=2 bash scripts/scale_train.sh regen-warm   # then the warm start
#
# Resumable: each shard resumes its own file (ids already answered are skipped); the merge, the tokens and the
# features run once. 256 new tokens, bf16, seed 21 by the line of the slice's prompts, as the stages.
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
R=${R:-runs/scale}
SLICE=${SLICE:-R4}
SHARDS=${SHARDS:-2}
PROCS=${PROCS:-2}
SLICING=${SLICING:-datasets/smollm2-135m-regenerated/slices.tsv}
NAME=T1$SLICE
SRC=$R/regenerated-R.jsonl
[ -f "$SRC" ] || R="$R" bash scripts/scale_archive.sh restore
row=$(awk -F'\t' -v n="$SLICE" '$1 == n' "$SLICING")
[ -n "$row" ] || { echo "no slice $SLICE in $SLICING"; exit 2; }
read -r _ start end <<<"$row"
[ "$end" -le "$(wc -l < "$SRC")" ] || { echo "slice $SLICE ends at line $end; $SRC has $(wc -l < "$SRC")"; exit 2; }
[ -n "${NUM:-}" ] && [ "$NUM" -lt $((end - start)) ] && end=$((start + NUM))
prompts=$R/prompts-$NAME.jsonl
[ -f "$prompts" ] || { sed -n "$((start + 1)),${end}p" "$SRC" > "$prompts.tmp" && mv "$prompts.tmp" "$prompts"; }
[ "$(wc -l < "$prompts")" -eq $((end - start)) ] || { echo "$prompts has $(wc -l < "$prompts") prompts, not" \
  "$((end - start)) (lines $start-$end of $SRC): move it aside"; exit 2; }
echo "slice $NAME: the $((end - start)) prompts of lines $start-$end of $SRC at temperature 1"
[ -f "$R/regen-$NAME.jsonl" ] || DSPARK=$DSPARK SHARDS=$SHARDS bash "$(dirname "$0")/regenerate_shards.sh" \
  "$prompts" "$R/regen-$NAME.jsonl" "$R/regen-$NAME" "$R/regen-$NAME" --temperature 1 --top-p 1 --top-k 0
[ -f "$R/tok-$NAME/manifest.json" ] || $DSPARK --threads 1 data tokenize --in "$R/regen-$NAME.jsonl" \
  --target smollm2-135m --out "$R/tok-$NAME" --max-length 1024
[ -f "$R/features-$NAME/manifest.json" ] && { echo "slice $NAME: $R/features-$NAME (built)"; exit 0; }
launch=($DSPARK --threads 1)
[ "$PROCS" -gt 1 ] && launch=($TORCHRUN --nproc_per_node "$PROCS" -m dspark.cli --threads 1)
"${launch[@]}" data features --config smollm2-dspark-markov --dtype bfloat16 --data "$R/tok-$NAME" \
  --out "$R/features-$NAME" --max-length 1024
echo "slice $NAME: $R/features-$NAME"
