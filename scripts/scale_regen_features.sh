#!/usr/bin/env bash
# The on-policy stage of the drafter-at-scale run (docs/reports/training-scale.md §On-policy answers): the records
# scripts/scale_regenerate.sh has written so far become the next slice of the training set. Each call takes the
# lines of regenerated-R.jsonl added since the last slice (a snapshot file, so the growing file is never read
# half-written), tokenizes them at 1,024 tokens and caches the target's features (bf16, PROCS processes), while the
# regeneration goes on. Training reads the finished slices as one list (scripts/scale_train.sh regen).
#
#   bash scripts/scale_regen_features.sh     # R=runs/scale PROCS=1 (one core: vLLM holds the other)
#   PROCS=2 bash scripts/scale_regen_features.sh all   # every slice still to make, one after the other
#   SLICE=R4 PROCS=2 bash scripts/scale_regen_features.sh   # one row of the committed slicing, out of order
#
# Resumable: an unfinished slice (interrupted features) is finished first, with the same number of processes;
# the slices so far are listed in $R/regen-slices.tsv (name, first line, end line). Where the committed slicing
# ($SLICING, default datasets/smollm2-135m-regenerated/slices.tsv, the same columns) names the next slice, it
# ends where that row says, so a fresh machine rebuilds the slices the reports name; append a row there for
# a new slice worth keeping. SLICE=NAME makes that row of the committed slicing now, whatever is listed before it
# (a sitting short of time: training reads the slices listed, in their order; later calls without SLICE go on after
# the last one listed).
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
R=${R:-runs/scale}
PROCS=${PROCS:-1}
SRC=$R/regenerated-R.jsonl
LIST=$R/regen-slices.tsv
SLICING=${SLICING:-datasets/smollm2-135m-regenerated/slices.tsv}
[ -f "$SRC" ] || { echo "no $SRC: run scripts/scale_regenerate.sh first"; exit 2; }
touch "$LIST"
last=$(tail -n 1 "$LIST")
if [ -n "${SLICE:-}" ]; then  # one committed row, out of order
  row=$(awk -F'\t' -v n="$SLICE" '$1 == n' "$SLICING" 2>/dev/null)
  [ -n "$row" ] || { echo "no slice $SLICE in $SLICING"; exit 2; }
  read -r name start end <<<"$row"
  [ "$end" -le "$(wc -l < "$SRC")" ] || { echo "slice $SLICE ends at line $end; $SRC has $(wc -l < "$SRC")"; exit 2; }
  awk -F'\t' -v n="$name" '$1 == n {found = 1} END {exit !found}' "$LIST" || printf '%s\t%s\t%s\n' "$name" "$start" "$end" >> "$LIST"
elif [ -n "$last" ] && [ ! -f "$R/features-$(cut -f1 <<<"$last")/manifest.json" ]; then
  read -r name start end <<<"$last"  # finish the slice an interruption left
else
  start=${last:+$(cut -f3 <<<"$last")}; start=${start:-0}
  end=$(wc -l < "$SRC")  # complete lines only: a record is written as one line
  [ "$end" -gt "$start" ] || { echo "no new records in $SRC since line $start"; exit 0; }
  name=R$(( $(awk -F'\t' '{n = substr($1, 2) + 0; if (n > m) m = n} END {print m + 0}' "$LIST") + 1 ))
  planned=""
  [ -f "$SLICING" ] && planned=$(awk -F'\t' -v n="$name" -v s="$start" '$1 == n && $2 == s {print $3}' "$SLICING")
  [ -n "$planned" ] && [ "$planned" -le "$end" ] && end=$planned
  printf '%s\t%s\t%s\n' "$name" "$start" "$end" >> "$LIST"
fi
echo "slice $name: records $start-$end of $SRC"
[ -f "$R/regen-$name.jsonl" ] || { sed -n "$((start + 1)),${end}p" "$SRC" > "$R/regen-$name.jsonl.tmp" \
  && mv "$R/regen-$name.jsonl.tmp" "$R/regen-$name.jsonl"; }
[ -f "$R/tok-$name/manifest.json" ] || $DSPARK --threads 1 data tokenize --in "$R/regen-$name.jsonl" \
  --target smollm2-135m --out "$R/tok-$name" --max-length 1024
launch=($DSPARK --threads 1)
[ "$PROCS" -gt 1 ] && launch=($TORCHRUN --nproc_per_node "$PROCS" -m dspark.cli --threads 1)
"${launch[@]}" data features --config smollm2-dspark-markov --dtype bfloat16 --data "$R/tok-$name" \
  --out "$R/features-$name" --max-length 1024
[ "${1:-}" = all ] && [ -z "${SLICE:-}" ] && exec bash "$0" all
exit 0
