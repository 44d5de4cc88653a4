"""The load benchmark's prompts: every packaged set, records whose strings hold Unicode line separators."""

import json

from dspark.bench.serve_load import EVAL_SETS, load_prompts
from dspark.data.eval_sets import find_eval_dir


def test_a_record_with_a_unicode_line_separator_stays_one_prompt(tmp_path):
    # JSON lets U+2028 and U+0085 stand unescaped inside a string; str.splitlines() would cut the record there
    texts = ["first\u2028still the first", "second\x85too", "third"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [t]}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert load_prompts(path) == texts


def test_the_mix_of_packaged_sets_reads_every_record():
    # arena-hard-v2 holds such a record; the mix takes the first `limit` records of each set, round robin
    prompts = load_prompts(limit=10_000)
    counts = []
    for name in EVAL_SETS:
        lines = (find_eval_dir() / f"{name}.jsonl").read_text(encoding="utf-8").split("\n")
        counts.append(sum(1 for ln in lines if ln.strip()))
    assert len(prompts) == min(len(EVAL_SETS) * min(counts), 10_000)
    assert all(isinstance(p, str) and p for p in prompts)
