#!/usr/bin/env bash
# What a longer training budget does: DSpark (Markov head) trained for BUDGET seconds in bf16 on one thread on the
# study's feature cache (6.6x the main study's tokens at the default), then DFlash for the same number of optimizer
# steps (same sequences seen), evaluated exactly as docs/results.md (all 8 sets, 2 samples each, 128 tokens,
# temperature 1.0) next to the study's own DSpark drafter.
# Writes docs/long-training.md. Steps already done (train_summary.json, results.json) are skipped.
#   bash bench/long_training.sh [BUDGET_SECONDS]     (needs runs/study from `dspark reproduce --budget cpu`)
set -euo pipefail
BUDGET=${1:-2700}
DSPARK=${DSPARK:-.venv/bin/dspark}
RUN=runs/study/train-long/dspark-markov
DFLASH=runs/study/train-long/dflash
EVAL=runs/study/eval-long
common=(--set data=runs/study/tok --set feature_source=cache --set cache_dir=runs/study/data/features
        --set max_length=512 --set num_threads=1 --set dtype=bfloat16)
if [ ! -f $RUN/train_summary.json ]; then
  $DSPARK train --config smollm2-dspark-markov --drafter dspark --out $RUN --resume "${common[@]}" \
    --set epochs=10 --set time_budget_s=$BUDGET
fi
STEPS=$(.venv/bin/python -c "import json; print(json.load(open('$RUN/train_summary.json'))['steps'])")
if [ ! -f $DFLASH/train_summary.json ]; then
  $DSPARK train --config smollm2-dflash --drafter dflash --out $DFLASH --resume "${common[@]}" --set max_steps=$STEPS
fi
if ! grep -q dflash-long $EVAL/results.json 2>/dev/null; then  # resumable: finished samples are kept
  $DSPARK --threads 1 eval --datasets all --limit 2 --max-new-tokens 128 --out $EVAL --no-progress \
    --drafter dspark-markov-long=$RUN/step_latest --drafter dspark-markov=runs/study/train/dspark-markov/step_latest \
    --drafter dflash-long=$DFLASH/step_latest
fi
.venv/bin/python - "$RUN" "$EVAL" "$BUDGET" <<'PY'
import json, shutil, sys
from pathlib import Path
run, ev, budget = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
summary = lambda p: json.loads(Path(p, "train_summary.json").read_text())
long, short, dflash = summary(run), summary("runs/study/train/dspark-markov"), summary("runs/study/train-long/dflash")
Path("docs/figures").mkdir(parents=True, exist_ok=True)
shutil.copy(ev / "acceptance_math.png", "docs/figures/long_training_acceptance_math.png")
rows = ["| drafter | training | steps | tokens seen | train tok/s | train acceptance at draft positions 1..7 | train tau |",
        "|---|---|---:|---:|---:|---|---:|"]
for name, s, how in (("dspark-markov", short, "540 s, float32, 2 threads (`dspark reproduce --budget cpu`)"),
                     ("dspark-markov-long", long, f"{budget} s, bfloat16, 1 thread (this script)"),
                     ("dflash-long", dflash, f"{dflash['steps']} steps like dspark-markov-long, bfloat16, 1 thread")):
    m = s["final_metrics"]
    rows.append(f"| {name} | {how} | {s['steps']} | {s['tokens_seen']:.0f} | {s['tokens_per_s']:.0f} | "
                f"{' '.join(f'{m[k]:.2f}' for k in sorted(m) if k.startswith('acc@'))} | {m['tau']:.3f} |")
table = (ev / "results.md").read_text().split("\n", 1)[1]
Path("docs/long-training.md").write_text(
    "# A longer training budget\n\n"
    f"Written by `bash bench/long_training.sh {budget}`: the study's DSpark (Markov head) configuration trained "
    f"again on the same feature cache (640 sequences, see study-data.md) for {budget} s in bfloat16 (fp32 master "
    "weights), then the study's DFlash configuration for the same number of optimizer steps (the same sequences; "
    "it ran alongside other jobs, so its seconds are not comparable), both evaluated exactly as results.md next "
    "to the study's DSpark drafter. The accuracies and tau of the training table are the trainer's own estimates "
    "on its last training batches: acc@k is the mean soft acceptance sum_v min(p_draft, p_target) at draft position k with teacher-forced previous tokens, tau = 1 + sum of their running products.\n\n" + "\n".join(rows) + "\n\n"
    "![per-position acceptance, math](figures/long_training_acceptance_math.png)\n\n" + table)
print("wrote docs/long-training.md")
PY
