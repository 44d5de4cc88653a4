"""docs/serving/peers.md's maths and format (scripts/serving_peers.sh's last step) from fabricated rows: a
formatter test, not a result."""

from __future__ import annotations

import json

import pytest

from dspark.studies.serving_peers import note_row, read_rows, speculative_config, write_peers

CONFIG = {"model": "~/.cache/dspark/models/smollm2-135m", "concurrency": "1,4", "num_requests": 8,
          "max_tokens": 32, "temperature": 0.0, "cpu_count": 2}


def _point(c: int, total: float, user: float, tau: float | None = None, requests: int = 8) -> dict:
    return {"policy": "server", "concurrency": c, "requests": requests, "errors": 0, "total_tokens_per_s": total,
            "user_tokens_per_s": user, "acceptance_length": tau, "avg_verify_len": None}


def _measured(work, name: str, engine: str, points: list[dict], load: float = 0.1) -> None:
    (work / name).mkdir(parents=True)
    (work / name / "serve_load.json").write_text(json.dumps({"rows": points[::-1]}))  # order must not matter
    note_row(work, {"name": name, "engine": engine, "method": "m", "status": "measured",
                    "command": f"serve {name}", "ready_s": 12.3, "load_before": load, "load_after": load + 0.2})


def _table(text: str) -> list[list[str]]:
    """The cells of the results table (not its header, not the servers' table, whose commands are `serve ...`)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| row") and "`serve" not in ln]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_ratios_against_vllm_plain_at_the_same_clients(tmp_path):
    _measured(tmp_path, "vllm-plain", "vllm", [_point(1, 20.0, 25.0), _point(4, 80.0, 20.0)])
    _measured(tmp_path, "dspark-plain", "dspark", [{**_point(1, 30.0, 20.0, 1.0), "draft_ms": 2.46, "verify_ms": 14.04},
                                                   _point(4, 40.0, 10.0, 1.0)])
    note_row(tmp_path, {"name": "vllm-eagle3", "engine": "vllm", "method": "eagle3", "status": "skipped",
                        "reason": "no Eagle3 checkpoint"})
    paths = write_peers(tmp_path, tmp_path / "out", CONFIG, "bash scripts/serving_peers.sh", "bash scripts/serving_peers.sh",
                        smoke=False)
    assert [p.name for p in paths] == ["peers.md", "peers.json", "peers.png"]
    text = paths[0].read_text()
    assert "Written by `bash scripts/serving_peers.sh`." in text
    assert "Smoke run" not in text and "other work" not in text  # load 0.1: nothing said about load
    rows = _table(text)
    assert [r[:4] for r in rows] == [["vllm-plain", "vllm", "m", "1"], ["vllm-plain", "vllm", "m", "4"],
                                     ["dspark-plain", "dspark", "m", "1"], ["dspark-plain", "dspark", "m", "4"]]
    # total vs, per-user vs: 30/20, 20/25 at 1 client; 40/80, 10/20 at 4
    assert [(r[6], r[8]) for r in rows[2:]] == [("1.50x", "0.80x"), ("0.50x", "0.50x")]
    assert [(r[6], r[8]) for r in rows[:2]] == [("1.00x", "1.00x")] * 2
    assert rows[0][9] == "–" and rows[2][9] == "1.00"  # vLLM plain has no tau
    assert rows[2][10:12] == ["2.5", "14.0"] and rows[0][10:12] == ["–", "–"]  # the engine's timings, dspark only
    assert rows[0][13] == "0.10 -> 0.30"
    assert "- `vllm-eagle3` (skipped): no Eagle3 checkpoint" in text
    saved = json.loads(paths[1].read_text())
    assert saved["rows"][1]["points"][0]["total_vs_baseline"] == pytest.approx(1.5)


def test_smoke_under_load_is_labelled(tmp_path):
    _measured(tmp_path, "dspark-plain", "dspark", [_point(1, 30.0, 20.0, 1.0)], load=3.5)
    text = write_peers(tmp_path, tmp_path, CONFIG, "NUM_REQUESTS=4 bash scripts/serving_peers.sh",
                       "bash scripts/serving_peers.sh", smoke=True)[0].read_text()
    assert "**Smoke run under load: not a result.**" in text
    assert "Full run: `bash scripts/serving_peers.sh`" in text
    assert "each engine placed on them as it chooses" in text
    assert "--max-tokens 32 --temperature 0`" in text
    pinned = write_peers(tmp_path, tmp_path, {**CONFIG, "cpus": "1", "temperature": 1.0}, "c", "c",
                         smoke=True)[0].read_text()
    assert "every server confined to core(s) 1" in pinned
    assert "--max-tokens 32 --temperature 1`" in pinned  # the load's temperature, as the script passed it
    assert _table(text)[0][6] == "–"  # no vLLM plain row: no ratio


def test_loaded_full_run_says_so(tmp_path):
    _measured(tmp_path, "vllm-plain", "vllm", [_point(1, 20.0, 25.0)], load=1.7)
    text = write_peers(tmp_path, tmp_path, CONFIG, "c", "c", smoke=False)[0].read_text()
    assert "load average up to 1.70 on 2 CPUs" in text and "Smoke run" not in text


def test_failed_point_gets_no_ratio(tmp_path):
    _measured(tmp_path, "vllm-plain", "vllm", [_point(1, 20.0, 25.0)])
    _measured(tmp_path, "dspark-all", "dspark", [_point(1, 0.0, 0.0, requests=0)])
    text = write_peers(tmp_path, tmp_path, CONFIG, "c", "c", smoke=False)[0].read_text()
    assert _table(text)[1][6] == "–"


def test_a_later_note_replaces_an_earlier_one_and_bad_notes_are_refused(tmp_path):
    note_row(tmp_path, {"name": "vllm-ngram", "engine": "vllm", "method": "ngram", "status": "failed",
                        "reason": "first try"})
    _measured(tmp_path, "vllm-ngram", "vllm", [_point(1, 20.0, 25.0)])
    rows = read_rows(tmp_path)
    assert len(rows) == 1 and rows[0]["status"] == "measured" and len(rows[0]["points"]) == 1
    with pytest.raises(ValueError, match="status"):
        note_row(tmp_path, {"name": "x", "engine": "vllm", "method": "m", "status": "ok"})
    note_row(tmp_path, {"name": "y", "engine": "dspark", "method": "m", "status": "measured"})
    with pytest.raises(ValueError, match="serve_load.json"):
        read_rows(tmp_path)


def test_speculative_config_of_the_printed_command():
    printed = ("wrote /tmp/x\nlaunch it with:\npython -m vllm.entrypoints.openai.api_server --model /m "
               "--speculative-config '{\"method\": \"eagle3\", \"model\": \"/tmp/x\", \"num_speculative_tokens\": 3}'\n")
    assert json.loads(speculative_config(printed)) == {"method": "eagle3", "model": "/tmp/x", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="speculative-config"):
        speculative_config("python -m vllm.entrypoints.openai.api_server --model /m\n")


def test_no_figure_without_a_measured_point(tmp_path):
    note_row(tmp_path, {"name": "vllm-plain", "engine": "vllm", "method": "plain", "status": "failed",
                        "reason": "the server exited before answering /health"})
    paths = write_peers(tmp_path, tmp_path, CONFIG, "c", "c", smoke=True)
    assert [p.name for p in paths] == ["peers.md", "peers.json"]
    text = paths[0].read_text()
    assert "peers.png" not in text and "- `vllm-plain` (failed): the server exited" in text


def test_per_user_speed_against_fixed1_at_matched_throughput(tmp_path):
    # fixed:1's curve: (60, 60) -> (150, 40) -> (220, 16); its 32-client point (210) no longer rises: cut there
    _measured(tmp_path, "dspark-fixed1", "dspark",
              [_point(1, 60.0, 60.0, 1.5), _point(4, 150.0, 40.0, 1.5), _point(16, 220.0, 16.0, 1.5),
               _point(32, 210.0, 8.0, 1.5)])
    _measured(tmp_path, "dspark-async", "dspark",
              [_point(1, 75.0, 80.0, 1.9), _point(4, 165.0, 45.0, 1.2), _point(16, 215.0, 21.0, 1.1),
               _point(32, 280.0, 10.0, 1.0)])
    _measured(tmp_path, "vllm-plain", "vllm", [_point(1, 50.0, 52.0)])
    # a row whose throughput falls back at its last level: that point is still matched on fixed:1's curve
    _measured(tmp_path, "dspark-plain", "dspark", [_point(1, 100.0, 50.0, 1.0), _point(4, 90.0, 30.0, 1.0)])
    paths = write_peers(tmp_path, tmp_path / "out", CONFIG, "c", "c", smoke=False)
    saved = json.loads(paths[1].read_text())["matched_fixed1"]
    plain = [m for m in saved if m["row"] == "dspark-plain"]
    assert [m["fixed1_user_tokens_per_s"] for m in plain] == [pytest.approx(60 - 20 * 40 / 90),
                                                             pytest.approx(60 - 20 * 30 / 90)]
    saved = [m for m in saved if m["row"] != "dspark-plain"]
    assert [m["row"] for m in saved] == ["dspark-async"] * 4  # neither fixed:1 itself nor a vLLM row
    # 75 tok/s lies between fixed:1's 60 and 150: 60 - 20 * 15 / 90; 165 between 150 and 220: 40 - 24 * 15 / 70
    expected = [60 - 20 * 15 / 90, 40 - 24 * 15 / 70, 40 - 24 * 65 / 70, None]  # 280 is past 220: not extrapolated
    assert [m["fixed1_user_tokens_per_s"] for m in saved] == [pytest.approx(e) if e else None for e in expected]
    assert saved[0]["ratio"] == pytest.approx(80 / expected[0]) and saved[3]["ratio"] is None
    text = paths[0].read_text()
    section = text[text.index("Per-user speed at matched throughput"):]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in section.splitlines()
            if ln.startswith("| dspark-async") and "`serve" not in ln]  # not the servers' table
    assert [(r[1], r[5]) for r in rows] == [("1", f"{80 / expected[0]:.2f}x"), ("4", f"{45 / expected[1]:.2f}x"),
                                            ("16", f"{21 / expected[2]:.2f}x"), ("32", "–")]


def test_no_matched_section_without_a_fixed1_row(tmp_path):
    _measured(tmp_path, "dspark-async", "dspark", [_point(1, 75.0, 80.0, 1.9)])
    paths = write_peers(tmp_path, tmp_path / "out", CONFIG, "c", "c", smoke=False)
    assert "matched throughput" not in paths[0].read_text()
    assert json.loads(paths[1].read_text())["matched_fixed1"] == []
