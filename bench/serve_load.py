"""Serving load benchmark (paper Figs. 7, 8): a thin wrapper around `dspark bench serve`.

    .venv/bin/python bench/serve_load.py                      # defaults: smollm2-135m, prompt lookup,
                                                              # fixed:1,alg1,async,all x concurrency 1,2,4,8
    .venv/bin/python bench/serve_load.py --concurrency 1,2 --num-requests 4 --max-tokens 32

Any `dspark bench serve` flag works; results go to docs/serving/ unless --out-dir says otherwise.
"""

from __future__ import annotations

import sys

from dspark.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
