#!/usr/bin/env bash
# The drafter-at-scale runs (docs/reports/training-scale.md) on the slices of scripts/scale_data.sh, and the scaling curve:
# DSpark (Markov head) and DFlash trained on the first N sequences of the labelled set for 3 passes each (equal
# steps per token), N = 330, 1000, 3500 and all 13,875 (about 0.1 M, 0.3 M, 1.1 M and 4.2 M tokens; 0.06 M,
# 0.2 M, 0.7 M and 2.7 M supervised), Qwen3-shaped draft layers (q/k RMSNorm: the layout SGLang and vLLM load),
# bf16 with fp32 master weights, an 8,192-token draft vocabulary. The largest DSpark is the reference drafter and
# the largest DFlash its twin; Eagle3 trains on the same data and steps (3 of the cached layers: it exports to vLLM).
# The two drafters of a point train side by side, one thread each; PROCS=2 trains them one after the other, each
# on both cores (torchrun, two DDP processes of one thread, the same global batch of 4 sequences).
#
# A run is longer than a sitting: every training stops after SESSION_S seconds with a checkpoint (session_time_s:
# the LR schedule stays the step count's) and the same command resumes it; finished runs are skipped.
#   bash scripts/scale_train.sh 330 1000        # points to train now (default: all four, then eagle3)
#   SESSION_S=3000 bash scripts/scale_train.sh all eagle3
#   PROCS=2 bash scripts/scale_train.sh all      # each drafter on both cores in turn
#   bash scripts/scale_train.sh depth2-3500      # the depth ablation: DSpark with 2 draft layers (dspark2-3500)
#   PROCS=2 bash scripts/scale_train.sh depth2-regen-all  # the same at the largest point: regen-all's DSpark with
#                                                # 2 draft layers (dspark2-regen-R3 after slice R3)
#   PROCS=2 bash scripts/scale_train.sh depth2-dflash-regen-all  # its DFlash twin at equal depth (dflash2-regen-R4)
#   PROCS=2 bash scripts/scale_train.sh depth3-regen-all  # any depth N = 2..9 the same way (dspark3-regen-R4)
#   PROCS=2 bash scripts/scale_train.sh depth2-rnn-regen-all  # DSpark with the RNN head (dsparkrnn2-regen-R4)
#   EPOCHS=1 TAG=t1mix-R4 SLICES="T1R4 R4" PROCS=2 bash scripts/scale_train.sh depth2-regen-all depth2-dflash-regen-all
#                                                # a DSpark / DFlash pair from scratch on other slices, named by TAG
#                                                # (dspark2-regen-t1mix-R4, dflash2-regen-t1mix-R4)
#   EPOCHS=1 TAG=t1mix-R4 SLICES="T1R4 R4" PROCS=2 bash scripts/scale_train.sh eagle3-regen-all  # Eagle3 beside
#                                                # them, same data, steps and 8,192-token draft vocabulary
#                                                # (eagle3-regen-t1mix-R4; its 7-step training-time test: about 4.5x
#                                                # a DSpark step's time on both cores, training-scale.md)
#   SETS="--set model.loss_decay_gamma=7" EPOCHS=1 TAG=g7-t1mix-R4 SLICES="T1R4 R4" PROCS=2 \
#     bash scripts/scale_train.sh depth2-regen-all depth2-dflash-regen-all  # the pair with extra training settings
#                                                # (SETS, word-split: here the paper's loss weights, gamma = 7)
#   bash scripts/scale_train.sh layer-target-330 # DSpark with the target family's draft layer (dsparktl-330)
#   bash scripts/scale_train.sh regen            # DSpark and DFlash on the on-policy slices (dspark-regen, dflash-regen)
#   bash scripts/scale_train.sh regen-cont       # both continued on every slice from dspark-regen / dflash-regen
#                                                # (CONT_EPOCHS=1 pass, CONT_LR=3e-4 peak, fresh optimizer and schedule;
#                                                # KINDS="dspark" continues DSpark only)
#   bash scripts/scale_train.sh regen-all        # from scratch on every slice so far (dspark-regen-R3 / dflash-regen-R3
#                                                # after slice R3; regen's settings, EPOCHS passes)
#   bash scripts/scale_train.sh regen-warm       # the shipped drafter (INIT=checkpoints/smollm2-135m-dspark) continued
#                                                # on every slice so far (dspark-regen-warm-R4 after slice R4;
#                                                # CONT_EPOCHS=1 pass, CONT_LR=3e-4, fresh optimizer and schedule,
#                                                # its own draft vocabulary): a fresh machine's shortest way to use
#                                                # new answers, since the shipped weights are in git; NAME=... names
#                                                # the run instead (a second warm start from INIT=runs/.../step_latest);
#                                                # LAYERS=3 grows the drafter (new layers start as no-ops), SLICES="R1"
#                                                # trains on those slices only (any regen run: SLICES="R1 R2 R3 R4"
#                                                # resumes depth3-regen-all's dspark3-regen-R4 once R5 is listed),
#                                                # SETS="--set model.num_anchors=64" adds training settings (the
#                                                # warm-start ablation of training-scale.md); SLICES="T1R4"
#                                                # reads scripts/scale_t1_answers.sh's slice; KIND=dflash continues
#                                                # a DFlash (INIT=its folder) with the same pass and settings
#   bash scripts/scale_train.sh regen-next       # the continued runs (*-regen-cont) one pass further on the newest
#                                                # slice only (*-regen-cont-R3 for slice R3; CONT_LR, KINDS as above)
set -euo pipefail
DSPARK=${DSPARK:-.venv/bin/dspark}
R=${R:-runs/scale}
SESSION_S=${SESSION_S:-100000}
EPOCHS=${EPOCHS:-3}
PROCS=${PROCS:-1}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
points=("$@")
[ ${#points[@]} -gt 0 ] || points=(330 1000 3500 all eagle3)

listed_slices() {  # the on-policy slices a regen run reads: SLICES="R1 R2" if given, else all in regen-slices.tsv
  if [ -n "${SLICES:-}" ]; then tr ' ' '\n' <<<"$SLICES"; else cut -f1 "$R/regen-slices.tsv"; fi
}

caches_for() {  # the slices that hold the first N sequences
  case "$1" in
    330|1000) echo "[\"$R/features-A\"]" ;;
    3500) echo "[\"$R/features-A\", \"$R/features-B\"]" ;;
    regen) listed_slices | sed "s|.*|\"$R/features-&\"|" | paste -sd, | sed 's/.*/[&]/' ;;
    *) echo "[\"$R/features-A\", \"$R/features-B\", \"$R/features-C\"]" ;;
  esac
}

train() {  # name preset caches max_samples extra...
  local name=$1 preset=$2 caches=$3 n=$4; shift 4
  local out="$R/train/$name"
  if [ -f "$out/train_summary.json" ] && grep -q '"stopped_by": "max_steps"' "$out/train_summary.json"; then
    return 0  # finished
  fi
  local limit=()
  [ "$n" = all ] || limit=(--set "max_samples=$n")
  local launch=($DSPARK --threads 1)
  # DDP: the global batch stays 4 sequences (grad_accum = 4 / PROCS)
  if [ "$PROCS" -gt 1 ]; then
    launch=($TORCHRUN --nproc_per_node "$PROCS" -m dspark.cli --threads 1)
    set -- "$@" --set grad_accum=null --set global_batch_size=4
  fi
  "${launch[@]}" train --config "$preset" --out "$out" --resume \
    --set "data=$R/tok-label-1k" --set "cache_dir=$caches" --set feature_source=cache --set max_length=1024 --set dtype=bfloat16 \
    --set draft_vocab_size=8192 --set epochs="$EPOCHS" --set checkpoint_every=100 --set keep_checkpoints=2 \
    --set session_time_s="$SESSION_S" "${limit[@]}" "$@" > "$out.log" 2>&1
}

mkdir -p "$R/train"
for p in "${points[@]}"; do
  if [ "$p" = eagle3 ]; then
    train eagle3-all smollm2-eagle3 "$(caches_for all)" all --set "model.target_layer_ids=[1,14,27]" \
      --set draft_vocab_size=null
    continue
  fi
  if [ "$p" = eagle3-regen-all ]; then  # Eagle3 on the listed on-policy slices: the data and steps of the regen runs
    slice=$(listed_slices | tail -n 1)
    train "eagle3-regen-${TAG:-$slice}" smollm2-eagle3 "$(caches_for regen)" all --set "data=[]" \
      --set "model.target_layer_ids=[1,14,27]"
    continue
  fi
  if [[ "$p" == layer-target-* ]]; then  # the draft-layer check: the target family's layer (no q/k norm)
    n=${p#layer-target-}
    train "dsparktl-$n" smollm2-dspark-markov "$(caches_for "$n")" "$n" --set model.draft_layer=target
    continue
  fi
  if [[ "$p" =~ ^depth([2-9])-(dflash-|rnn-)?regen-all$ ]]; then  # the depth ablation at the largest point: regen-all's
    depth=${BASH_REMATCH[1]} kind=dspark preset=smollm2-dspark-markov head=()  # DSpark with N draft layers, its DFlash
    case ${BASH_REMATCH[2]} in  # twin, or DSpark with the RNN head of eq. (6) instead of the vanilla Markov one
      dflash-) kind=dflash preset=smollm2-dflash ;;
      rnn-) kind=dsparkrnn head=(--set model.markov_head_type=rnn) ;;
    esac
    slice=$(listed_slices | tail -n 1)  # SLICES="R1 R2 R3 R4" resumes the run named after R4 once R5 is listed
    slice=${TAG:-$slice}  # TAG=x names the run ${kind}${depth}-regen-x instead (another mix of slices)
    # shellcheck disable=SC2086  # SETS: extra --set arguments (the loss-decay check of training-scale.md)
    train "${kind}${depth}-regen-$slice" "$preset" "$(caches_for regen)" all --set model.draft_layer=qwen3 \
      --set "model.num_draft_layers=$depth" --set "data=[]" "${head[@]}" ${SETS:-}
    continue
  fi
  if [[ "$p" == depth2-* ]]; then  # the depth ablation: DSpark with 2 draft layers at point N
    n=${p#depth2-}
    train "dspark2-$n" smollm2-dspark-markov "$(caches_for "$n")" "$n" --set model.draft_layer=qwen3 \
      --set model.num_draft_layers=2
    continue
  fi
  if [[ "$p" == regen* ]] && [ -z "${SLICES:-}" ] && [ ! -s "$R/regen-slices.tsv" ]; then
    echo "no slices in $R/regen-slices.tsv: run scripts/scale_regen_features.sh first"; exit 2
  fi
  if [ "$p" = regen-cont ]; then  # warm start: the regen runs continued on the grown set of answers
    caches=$(caches_for regen)
    for kind in ${KINDS:-dspark dflash}; do
      preset=smollm2-dspark-markov; [ $kind = dflash ] && preset=smollm2-dflash
      init="$R/train/$kind-regen/step_latest"
      [ -d "$init" ] || { echo "no $init: train the regen point first"; exit 2; }
      EPOCHS=${CONT_EPOCHS:-1} train "$kind-regen-cont" $preset "$caches" all --set model.draft_layer=qwen3 \
        --set "data=[]" --set "lr=${CONT_LR:-0.0003}" --set "init_from=$init" &
      [ "$PROCS" -gt 1 ] && wait
    done
    wait
    continue
  fi
  if [ "$p" = regen-warm ]; then  # warm start from a drafter folder (the shipped one) on every slice
    init=${INIT:-checkpoints/smollm2-135m-dspark}
    [ -f "$init/config.json" ] || { echo "no drafter at $init (INIT=...)"; exit 2; }
    slice=$(listed_slices | tail -n 1)
    caches=$(caches_for regen)
    layers=${LAYERS:-$(grep -o '"num_hidden_layers": *[0-9]*' "$init/config.json" | grep -o '[0-9]*$')}
    # shellcheck disable=SC2086  # SETS: extra --set arguments, word-split on purpose
    case ${KIND:-dspark} in
      dspark) preset=smollm2-dspark-markov ;;
      dflash) preset=smollm2-dflash ;;
      *) echo "KIND=$KIND: regen-warm continues a dspark or a dflash drafter"; exit 2 ;;
    esac
    EPOCHS=${CONT_EPOCHS:-1} train "${NAME:-${KIND:-dspark}-regen-warm-$slice}" $preset "$caches" all \
      --set model.draft_layer=qwen3 --set "data=[]" --set "lr=${CONT_LR:-0.0003}" --set "init_from=$init" \
      --set "model.num_draft_layers=$layers" ${SETS:-}
    continue
  fi
  if [ "$p" = regen-next ]; then  # warm start again: the continued runs on the newest slice of answers
    slice=$(tail -n 1 "$R/regen-slices.tsv" | cut -f1)
    for kind in ${KINDS:-dspark dflash}; do
      preset=smollm2-dspark-markov; [ $kind = dflash ] && preset=smollm2-dflash
      init="$R/train/$kind-regen-cont/step_latest"
      [ -d "$init" ] || { echo "no $init: run regen-cont first"; exit 2; }
      EPOCHS=${CONT_EPOCHS:-1} train "$kind-regen-cont-$slice" $preset "[\"$R/features-$slice\"]" all \
        --set model.draft_layer=qwen3 --set "data=[]" --set "lr=${CONT_LR:-0.0002}" --set "init_from=$init" &
      [ "$PROCS" -gt 1 ] && wait
    done
    wait
    continue
  fi
  caches=$(caches_for "$p")
  if [ "$p" = regen ] || [ "$p" = regen-all ]; then  # the target's own answers (scale_regen_features.sh): every slice
    [ "$p" = regen-all ] && p="regen-$(tail -n 1 "$R/regen-slices.tsv" | cut -f1)" && caches=$(caches_for regen)
    set -- --set "data=[]"  # the draft vocabulary is counted over the caches
    p_n=all
  else
    set --
    p_n=$p
  fi
  if [ "$PROCS" -gt 1 ]; then
    train "dspark-$p" smollm2-dspark-markov "$caches" "$p_n" --set model.draft_layer=qwen3 "$@"
    train "dflash-$p" smollm2-dflash "$caches" "$p_n" --set model.draft_layer=qwen3 "$@"
  else
    train "dspark-$p" smollm2-dspark-markov "$caches" "$p_n" --set model.draft_layer=qwen3 "$@" &
    train "dflash-$p" smollm2-dflash "$caches" "$p_n" --set model.draft_layer=qwen3 "$@" &
    wait
  fi
done
