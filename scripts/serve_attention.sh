#!/usr/bin/env bash
# Serving throughput before and after batched attention, same load, same machine, one run each:
#   bash scripts/serve_attention.sh [BASE_COMMIT]      (default BASE_COMMIT: f451811, the last per-request commit)
# Runs `dspark --threads 1 bench serve --drafter none --dtype bfloat16 --policies all --concurrency 1,4,16
# --num-requests 16 --max-tokens 64 --temperature 0` on BASE_COMMIT's source (git archive into a temporary
# folder) and then on this tree, and writes docs/serving/attention.md (plus both runs' JSON and figures under
# docs/serving/attention/). Needs the package's dependencies in the Python given as $PY (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-f451811}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
OUT=docs/serving/attention
LOAD=(--threads 1 bench serve --drafter none --dtype bfloat16 --policies all --concurrency 1,4,16
      --num-requests 16 --max-tokens 64 --temperature 0)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
git archive "$BASE" src | tar -x -C "$TMP"
mkdir -p "$OUT/before" "$OUT/after"
PYTHONPATH="$TMP/src" "$PY" -m dspark.cli "${LOAD[@]}" --out-dir "$OUT/before"
PYTHONPATH="$PWD/src" "$PY" -m dspark.cli "${LOAD[@]}" --out-dir "$OUT/after"
PYTHONPATH="$PWD/src" "$PY" - "$BASE" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
from dspark.tables import fmt, markdown_table
base, out = sys.argv[1], Path(sys.argv[2])
before = {r["concurrency"]: r for r in json.loads((out / "before/serve_load.json").read_text())["rows"]}
after = {r["concurrency"]: r for r in json.loads((out / "after/serve_load.json").read_text())["rows"]}
rows = [[str(c), fmt(before[c]["total_tokens_per_s"], 1), fmt(after[c]["total_tokens_per_s"], 1),
         fmt(after[c]["total_tokens_per_s"] / before[c]["total_tokens_per_s"], 2) + "x",
         fmt(before[c]["user_tokens_per_s"], 1), fmt(after[c]["user_tokens_per_s"], 1)] for c in sorted(after)]
table = markdown_table(["clients", f"total tok/s at {base}", "total tok/s now", "ratio",
                        f"per-user tok/s at {base}", "per-user tok/s now"], rows)
(out.parent / "attention.md").write_text(
    "# Serving with batched attention\n\nWritten by `bash scripts/serve_attention.sh " + base + "`: `dspark --threads 1 "
    "bench serve --drafter none --dtype bfloat16 --policies all --concurrency 1,4,16 --num-requests 16 "
    "--max-tokens 64 --temperature 0` on the source of commit " + base + " (attention as a loop over requests "
    "in every layer) and on this tree (one call per layer over the KV pool), one after the other on the same "
    "machine. Full rows: attention/before/serve_load.md, attention/after/serve_load.md.\n\n"
    + "\n".join(table) + "\n")
print((out.parent / "attention.md").read_text())
EOF
