#!/usr/bin/env bash
# Has the drafter memorised its answers? The trainer-style teacher-forced metrics (tau estimate, acc@k, loss:
# `val_*`, docs/training.md) of a drafter on answers it trained on against answers to prompts it never saw, the
# same sources in the same numbers, the same sampling and length: held-out values well below the trained ones say
# the drafter is short of data; level ones that more of the same data adds steps, not knowledge.
#
#   bash scripts/heldout_check.sh                   # DRAFTER=checkpoints/smollm2-135m-dspark NUM=480 R=runs/scale
#   SAMPLING="--temperature 1 --top-p 1 --top-k 0" H=runs/scale/heldout-t1 bash scripts/heldout_check.sh
#                                                   # the held-out and benchmark answers sampled as the temperature-1
#                                                   # evaluation samples: is the drafter worse on such contexts?
#
# Held-out: `dspark data prompts --num NUM --seed 31` (another draw of the same prompt sources), those whose ids the
# training answers ($R/regenerated-R.jsonl) hold dropped, answered by the target in process as
# scripts/scale_regenerate.sh does (DeepSpec sampling, 256 new tokens, seed 31). Trained: as many training answers of
# each prompt source as the held-out side has, the first in the file. Both tokenized at 1,024 tokens and cached
# (bf16), then read as the validation set of a one-step run from DRAFTER (`--init-from`), whose step-0 line is the
# drafter's own values. A third side, benchmarks: the evaluation sets' rows beyond their caps (`dspark calibrate`'s
# held-out rows, up to 40 a set, disjoint from the evaluated ones) answered the same way: how far the evaluation's
# prompts lie from the training sources. Resumable (each stage skips what is written); results in $H/heldout.json.
set -euo pipefail
cd "$(dirname "$0")/.."
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${R:-runs/scale}
H=${H:-$R/heldout}
NUM=${NUM:-480}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-dspark}
read -r -a SAMPLING <<< "${SAMPLING:-}"  # extra `dspark data regenerate` options for the answers made here
[ -f "$R/regenerated-R.jsonl" ] || { echo "no $R/regenerated-R.jsonl (the training answers): bash scripts/scale_archive.sh restore"; exit 2; }
mkdir -p "$H"
if [ ! -f "$H/prompts.jsonl" ]; then
  $DSPARK data prompts --out "$H/prompts-all.jsonl" --num "$NUM" --seed 31
  .venv/bin/python - "$R/regenerated-R.jsonl" "$H/prompts-all.jsonl" "$H/prompts.jsonl" <<'PY'
import json, sys
train, drawn, out = sys.argv[1:]
seen = {json.loads(line)["id"] for line in open(train, encoding="utf-8")}
lines = open(drawn, encoding="utf-8").readlines()
new = [line for line in lines if json.loads(line)["id"] not in seen]
open(out, "w", encoding="utf-8").writelines(new)
print(f"{len(new)} held-out prompts ({len(lines) - len(new)} drawn ones were answered for training)")
PY
fi
$DSPARK --threads 1 data regenerate --prompts "$H/prompts.jsonl" --out "$H/regenerated.jsonl" --dtype bfloat16 \
  --batch-size 32 --max-new-tokens 256 --seed 31 "${SAMPLING[@]}"
if [ ! -f "$H/trained.jsonl" ]; then  # the same prompt sources in the same numbers, from the training answers
  .venv/bin/python - "$R/regenerated-R.jsonl" "$H/regenerated.jsonl" "$H/trained.jsonl" <<'PY'
import collections, json, sys
train, held, out = sys.argv[1:]
want = collections.Counter(json.loads(line)["source"] for line in open(held, encoding="utf-8"))
picked = []
for line in open(train, encoding="utf-8"):
    source = json.loads(line)["source"]
    if want[source] > 0:
        want[source] -= 1
        picked.append(line)
open(out, "w", encoding="utf-8").writelines(picked)
short = {s: n for s, n in want.items() if n > 0}
print(f"{len(picked)} training answers, the held-out sources' numbers" + (f" (short of {short})" if short else ""))
PY
fi
if [ ! -f "$H/benchmarks.jsonl" ]; then  # the benchmarks' rows beyond their evaluation caps, up to 40 a set
  .venv/bin/python - "$H/benchmarks-prompts.jsonl" <<'PY'
import json, sys
from dspark.data.eval_sets import heldout_dataset, heldout_names
with open(sys.argv[1], "w", encoding="utf-8") as f:
    for name in heldout_names():
        data = heldout_dataset(name, limit=40)
        for s in data.samples:
            f.write(json.dumps({"id": f"{name}-{s.idx}", "domain": data.domain, "source": name,
                                "conversations": [{"role": "user", "content": s.prompt}]}) + "\n")
PY
  $DSPARK --threads 1 data regenerate --prompts "$H/benchmarks-prompts.jsonl" --out "$H/benchmarks.jsonl.part" \
    --dtype bfloat16 --batch-size 32 --max-new-tokens 256 --seed 31 "${SAMPLING[@]}"
  mv "$H/benchmarks.jsonl.part" "$H/benchmarks.jsonl"
fi
for side in trained heldout benchmarks; do
  src=$H/regenerated.jsonl; [ $side = trained ] && src=$H/trained.jsonl; [ $side = benchmarks ] && src=$H/benchmarks.jsonl
  [ -f "$H/tok-$side/manifest.json" ] || $DSPARK --threads 1 data tokenize --in "$src" --target smollm2-135m \
    --out "$H/tok-$side" --max-length 1024
  [ -f "$H/features-$side/manifest.json" ] || $DSPARK --threads 1 data features --config smollm2-dspark-markov \
    --dtype bfloat16 --data "$H/tok-$side" --out "$H/features-$side" --max-length 1024
done
layers=$(grep -o '"num_hidden_layers": *[0-9]*' "$DRAFTER/config.json" | grep -o '[0-9]*$')
for side in trained heldout benchmarks; do
  rm -rf "$H/run-$side"
  $DSPARK --threads 1 train --config smollm2-dspark-markov --out "$H/run-$side" --init-from "$DRAFTER" \
    --set "data=[]" --set "cache_dir=$H/features-$side" --set feature_source=cache --set max_length=1024 \
    --set dtype=bfloat16 --set model.draft_layer=qwen3 --set "model.num_draft_layers=$layers" --set max_steps=1 \
    --set grad_accum=1 --set "val_cache_dir=$H/features-$side" --set "val_samples=$NUM" --set val_every=1000 \
    > "$H/run-$side.log" 2>&1
done
.venv/bin/python - "$H" "$DRAFTER" <<'PY'
import json, sys
from pathlib import Path
h, drafter = Path(sys.argv[1]), sys.argv[2]
out = {"drafter": drafter}
for side in ("trained", "heldout", "benchmarks"):
    line = next(json.loads(l) for l in (h / f"run-{side}" / "metrics.jsonl").read_text().splitlines()
                if json.loads(l).get("step") == 0 and "val_loss" in l)
    out[side] = {k: v for k, v in line.items() if k != "step"}
(h / "heldout.json").write_text(json.dumps(out, indent=2) + "\n")
keys = ["val_tau", "val_acc@0", "val_acc@1", "val_acc@2", "val_loss", "val_l1"]
print("| answers | " + " | ".join(k.removeprefix("val_") for k in keys) + " |")
for side in ("trained", "heldout", "benchmarks"):
    print(f"| {side} | " + " | ".join(f"{out[side].get(k, float('nan')):.3f}" for k in keys) + " |")
PY
