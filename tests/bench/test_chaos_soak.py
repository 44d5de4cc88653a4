"""The soak benchmark's plan and page (the soak itself is a benchmark: `dspark bench chaos --soak N`)."""

from __future__ import annotations

from dspark.bench.chaos_soak import BEGIN, END, KINDS, SoakConfig, plan, render_soak, write_soak_section


def test_the_plan_is_seeded_and_mixes_every_kind():
    a, b = plan(SoakConfig(requests=600)), plan(SoakConfig(requests=600))
    assert a == b and len(a) == 600
    assert {r["kind"] for r in a} == set(KINDS)
    assert 0.3 < sum(r["stream"] for r in a) / len(a) < 0.7
    assert all(r["body"]["max_tokens"] <= 6 for r in a if r["kind"] not in ("bad", "cancel"))
    assert plan(SoakConfig(requests=600, seed=1)) != a


def _result(n: int = 2000) -> dict:
    samples = [{"requests": k, "rss_mib": 1000.0 + k / 100, "seconds": k / 10.0, "health_worst_s": 0.01}
               for k in range(0, n + 1, 100)]
    samples.append({"requests": n, "rss_mib": 1021.0, "seconds": n / 10 + 5, "idle": True})
    return {"config": {**SoakConfig(requests=n).__dict__}, "samples": samples, "outcomes": {"short: ok": n},
            "shutdown": {"streams": 8, "exit_s": 5.5, "returncode": 0, "ends": {"error event": 8}, "timeout_s": 5.0},
            "heavy": [{"name": "x", "bytes": 10, "status": 400, "seconds": 0.1, "health_worst_s": 0.02,
                       "health_failures": 0}],
            "tracebacks": 0, "cancelled_errors": 0, "kinds": {k: 1 for k in KINDS}, "streams": 5}


def test_the_page_reports_rss_per_thousand_and_the_ratio(tmp_path):
    text = render_soak(_result(), "dspark bench chaos --soak 2000")
    assert "| 1000 | 1010 |" in text and "| 2000 | 1020 |" in text
    assert "**1.010**" in text  # 1020 / 1010
    assert "Unexpected outcomes (5xx, cut streams, refused good requests): 0" in text
    page = tmp_path / "reliability.md"
    page.write_text("# Reliability\n\nchaos text\n")
    write_soak_section(_result(), "cmd", page)
    write_soak_section(_result(3000), "cmd", page)  # replaces its own section, keeps the rest
    body = page.read_text()
    assert body.count(BEGIN) == 1 and body.count(END) == 1 and "chaos text" in body and "| 3000 |" in body


def test_a_rerun_keeps_the_hand_written_block_the_soak_and_what_follows(tmp_path, monkeypatch):
    """`dspark bench chaos` rewrites its own sections only: the kept block, the Soak section and the text after
    it survive, in order; a hand-written section outside the markers does not (the reason for the markers)."""
    from dspark.bench import chaos

    monkeypatch.setattr(chaos, "render", lambda result, command: "# Reliability\n\nnew tables\n")
    page = tmp_path / "reliability.md"
    page.write_text("# Reliability\n\nold tables\n\n## Loose notes\n\nlost\n\n"
                    f"{chaos.KEEP_BEGIN}\n## Where it waited\n\nkept\n{chaos.KEEP_END}\n\n"
                    f"{BEGIN}\n## Soak\n\nrss\n{END}\n\n### Earlier soaks\n\nhistory\n")
    chaos.write_page({}, "cmd", page)
    text = page.read_text()
    assert "new tables" in text and "old tables" not in text and "lost" not in text
    order = [text.index(x) for x in ("new tables", "## Limits and shutdown", "kept", "## Soak", "history")]
    assert order == sorted(order)
    chaos.write_page({}, "cmd", page)  # a second rerun changes nothing more
    assert page.read_text() == text
