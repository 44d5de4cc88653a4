"""Single-request decoding speed (docs/reports/performance.md): a thin wrapper around `dspark bench speed`.

    .venv/bin/python bench/speed.py --draft-lm runs/smollm2-draft-lm/step_latest \
        --drafter dspark-markov=runs/smollm2-dspark-markov/step_latest \
        --drafter dspark-rnn=runs/smollm2-dspark-rnn/step_latest \
        --drafter dflash=runs/smollm2-dflash/step_latest --drafter eagle3=runs/smollm2-eagle3/step_latest \
        --block-sizes 7,4,2
    .venv/bin/python bench/speed.py --sets gsm8k --per-set 1 --max-new-tokens 16   # a smoke run

Any `dspark bench speed` flag works; results go to docs/performance/ and its section of
docs/reports/performance.md unless --out-dir / --doc say otherwise.
"""

from __future__ import annotations

import sys

from dspark.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "speed", *sys.argv[1:]]))
