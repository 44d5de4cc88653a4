"""The load benchmark's prompts (every packaged set, records whose strings hold Unicode line separators) and what a
point reads from the server's /metrics."""

import json

import pytest

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


def test_run_point_reads_the_engines_step_times_from_its_metrics(monkeypatch):
    """draft ms = the drafter's seconds over the steps that drafted, verify ms = verify seconds over all steps, both
    as differences of /metrics across the point; None where no step drafted (a vLLM server, plain decoding)."""
    from dspark.bench import serve_load

    def scrape(drafted: float, draft_s: float, verify_s: float, steps: float) -> dict:
        model = (("model", "m"),)
        return {("dspark_drafted_steps_total", model): drafted, ("dspark_engine_steps_total", model): steps,
                ("dspark_request_steps_total", model): 2 * steps,
                ("dspark_step_seconds_total", (("model", "m"), ("phase", "draft"))): draft_s,
                ("dspark_step_seconds_total", (("model", "m"), ("phase", "verify"))): verify_s,
                ("dspark_step_seconds_total", (("model", "m"), ("phase", "prefill"))): 99.0}

    samples = iter([scrape(10, 1.0, 5.0, 20), scrape(30, 1.1, 5.6, 60), scrape(30, 1.1, 5.6, 60),
                    scrape(30, 1.1, 6.0, 70)])
    monkeypatch.setattr(serve_load, "scrape_metrics", lambda url, key=None: next(samples))

    async def no_load(*args, **kwargs):
        return [], 1.0

    monkeypatch.setattr(serve_load, "closed_loop", no_load)
    row = serve_load.run_point("http://x", ["p"], 1, 1, 4)
    assert row["draft_ms"] == pytest.approx(1000 * 0.1 / 20) and row["verify_ms"] == pytest.approx(1000 * 0.6 / 40)
    row = serve_load.run_point("http://x", ["p"], 1, 1, 4)  # steps, none drafting
    assert row["draft_ms"] is None and row["verify_ms"] == pytest.approx(1000 * 0.4 / 10)
