"""Simulator inputs: drafter statistics (own files, `dspark eval` results), SPS checks, the paper's numbers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark.cli import main
from dspark.evaluation.calibration import position_bins
from dspark.generation.stats import AcceptanceStats
from dspark.scheduler.sps import SPSTable
from dspark.simulate.cli import load_sps
from dspark.simulate.paper import TABLE1, DOMAINS, auroc_of_bins, fit_curves, paper_drafters, tau_of
from dspark.simulate.stats import KIND, StatsError, from_eval_results, load_stats


def stats_file(tmp_path, **domain) -> str:
    d = {"proposal_lengths": [0, 0, 1], "conditional_acceptance": [0.8, 0.6], "confidence_bins": None, **domain}
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"kind": KIND, "name": "x", "block_size": 2, "domains": {"chat": d}}))
    return str(path)


@pytest.mark.parametrize("domain, message", [
    ({"conditional_acceptance": [0.8]}, "list of 2 numbers"),
    ({"conditional_acceptance": [0.8, 1.5]}, r"in \[0.0, 1.0\], got 1.5"),
    ({"proposal_lengths": [0, 0, 0]}, "all zero"),
    ({"confidence_bins": [[[0.9, 1, 0.8], [0.5, 1, 0.8]], [[0.6, 1, 0.6]]]}, "strictly increasing"),
    ({"confidence_bins": [[[0.2, 1, 0.2]], [[0.6, 1, 0.6]]]}, "different runs"),
])
def test_bad_statistics_name_the_file_and_the_problem(tmp_path, domain, message) -> None:
    path = stats_file(tmp_path, **domain)
    with pytest.raises(StatsError, match=message) as err:
        load_stats(path)
    assert str(err.value).startswith(path) and "\n" not in str(err.value)


def test_other_block_size_and_broken_json_are_refused(tmp_path) -> None:
    with pytest.raises(StatsError, match="block size 2.*block size 7"):
        load_stats(stats_file(tmp_path), block_size=7)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(StatsError, match=f"{bad}: not valid JSON"):
        load_stats(bad)
    with pytest.raises(StatsError, match="no such statistics file"):
        load_stats(tmp_path / "missing.json")


def test_sps_tables_in_tokens_per_second_or_malformed_are_refused(tmp_path) -> None:
    tokens_per_s = tmp_path / "tps.json"
    SPSTable((1, 8, 16), (10.0, 70.0, 120.0), 16).save(tokens_per_s)
    with pytest.raises(StatsError, match=f"{tokens_per_s}: steps/s rise"):
        load_sps(str(tokens_per_s))
    unsorted = tmp_path / "unsorted.json"
    unsorted.write_text(json.dumps({"sample_batch_tokens": [8, 1], "sample_steps_per_sec": [1.0, 2.0],
                                    "max_batch_tokens": 8}))
    with pytest.raises(StatsError, match=f"{unsorted}.*strictly increasing"):
        load_sps(str(unsorted))
    SPSTable((1, 8), (10.0, 9.0), 8).save(tmp_path / "ok.json")
    assert load_sps(str(tmp_path / "ok.json")).sps(8) == 9.0


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys) -> None:
    SPSTable((1, 8), (10.0, 9.0), 8).save(tmp_path / "sps.json")
    code = main(["simulate", "--sps-table", str(tmp_path / "sps.json"),
                 "--stats", stats_file(tmp_path, conditional_acceptance=[0.8]), "--users", "1",
                 "--num-requests", "1", "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "stats.json" in err and "conditional_acceptance" in err


def test_cli_refuses_a_file_as_out_dir_before_simulating(tmp_path, capsys) -> None:
    SPSTable((1, 8), (10.0, 9.0), 8).save(tmp_path / "sps.json")
    (tmp_path / "out").write_text("not a folder")
    code = main(["simulate", "--sps-table", str(tmp_path / "sps.json"), "--stats", stats_file(tmp_path),
                 "--users", "1", "--num-requests", "1", "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "is a file, not a folder" in err


def test_cli_writes_report(tmp_path) -> None:
    SPSTable((1, 8), (10.0, 9.0), 8).save(tmp_path / "sps.json")
    code = main(["simulate", "--sps-table", str(tmp_path / "sps.json"), "--stats", stats_file(tmp_path),
                 "--users", "1,2", "--num-requests", "4", "--output-len", "8", "--policies", "fixed:1,alg1",
                 "--out-dir", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "simulate.json").read_text())["rows"]
    assert code == 0 and {(r["policy"], r["concurrency"]) for r in rows} == {
        (p, u) for p in ("fixed:1", "alg1") for u in (1.0, 2.0)}
    assert (tmp_path / "out" / "verify_budget.png").is_file()


def test_eval_statistics_round_trip() -> None:
    """results.json counters and position_bins -> the simulator's per-benchmark statistics."""
    stats = AcceptanceStats(2)
    for proposal, accepted in [(2, 2), (2, 1), (2, 0), (0, 0), (1, 1)]:
        stats.add_step(proposal, accepted, accepted + 1)
    logits = torch.tensor([[2.0, 2.0], [2.0, -2.0], [-2.0, 0.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    bins = position_bins(logits, mask, torch.tensor([2, 1, 0]))
    assert [sum(b["count"] for b in pos) for pos in bins] == [3, 2]  # position 2 only where draft 1 was accepted
    summary = {"num_samples": 1, "stats": {"block_size": 2, "counts": stats.counts,
                                           "sum_acceptance_length": stats.sum_acceptance_length},
               "confidence": {"position_bins": bins}}
    results = {"settings": {"policy": None}, "drafters": {"d": {"benchmarks": {"gsm8k": summary}}}}
    with pytest.raises(ValueError, match="different runs"):  # bins of other steps than the counters
        from_eval_results(results, "d")
    summary["confidence"] = None
    sim = from_eval_results(results, "d")
    dom = sim.domains["gsm8k"]
    assert dom.proposal_lengths == (1.0, 1.0, 3.0)
    assert dom.conditional_acceptance == pytest.approx(stats.per_position_acceptance())
    with pytest.raises(ValueError, match="no drafter 'x'"):
        from_eval_results(results, "x")


def test_paper_curves_reproduce_table1_and_keep_the_stated_values() -> None:
    fits = fit_curves("Qwen3-8B")
    for drafter, domains in fits.items():
        for dom, f in domains.items():
            taus = TABLE1["Qwen3-8B"][drafter]
            assert tau_of(torch.tensor(f["curve"]).numpy()) == pytest.approx(
                sum(taus[i] for i in DOMAINS[dom]) / 3, abs=0.01)
            for pos, value in f["stated"].items():
                if pos == 1:
                    assert f["curve"][0] == pytest.approx(value)
    dspark = paper_drafters()["DSpark"]
    assert dspark.has_confidence and not paper_drafters()["DFlash"].has_confidence
    for pos in dspark.domains["chat"].confidence_bins:
        assert auroc_of_bins([list(b) for b in pos]) == pytest.approx(0.85, abs=0.01)


def test_roofline_table_is_flat_then_jagged_and_exact() -> None:
    from dspark.simulate.roofline import dense_8b_h200

    roof = dense_8b_h200()
    table = roof.table()
    times = [1 / table.sps(b) for b in range(1, roof.max_batch_tokens + 1)]
    assert times == pytest.approx([roof.step_seconds(b) for b in range(1, roof.max_batch_tokens + 1)])
    flat = roof.ridge_tokens()
    assert 64 <= flat < 512 and times[flat - 1] == times[0] and times[flat] > times[0]
    assert all(b >= a for a, b in zip(times, times[1:]))  # never faster with more tokens


def test_sampler_draws_bins_by_weight_and_acceptance_by_bin() -> None:
    """DraftSampler against the stated frequencies: proposal lengths, confidence bins per (domain, position),
    acceptance per bin (binomial bounds, 5 sigma); a shuffled table (negative control) fails the same check."""
    import numpy as np

    from dspark.simulate.stats import DraftSampler, stats_from_dict

    bins = [[[0.2, 1.0, 0.1], [0.5, 2.0, 0.5], [0.9, 1.0, 0.95]], [[0.3, 3.0, 0.2], [0.7, 1.0, 0.8]]]
    raw = {"kind": KIND, "name": "x", "block_size": 2, "domains": {
        "math": {"weight": 1.0, "proposal_lengths": [1, 1, 2], "conditional_acceptance": [0.5125, 0.35],
                 "confidence_bins": bins},
        "chat": {"weight": 3.0, "proposal_lengths": [0, 0, 1], "conditional_acceptance": [0.3, 0.9],
                 "confidence_bins": [[[0.4, 1.0, 0.3]], [[0.6, 1.0, 0.9]]]}}}
    sampler = DraftSampler(stats_from_dict(raw))
    rng = np.random.default_rng(0)
    n = 40_000
    domains = np.full(n, sampler.names.index("math"))
    num_tokens, conf, accepted = sampler.draw(domains, rng)

    def close(observed: float, p: float) -> bool:
        return abs(observed - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12

    assert all(close(float(np.mean(num_tokens == k)), p) for k, p in enumerate([0.25, 0.25, 0.5]))
    for k, rows in enumerate(bins):
        total = sum(w for _, w, _ in rows)
        for c, w, acc in rows:
            hit = conf[:, k] == c
            assert close(float(hit.mean()), w / total)
            assert abs(float(accepted[hit, k].mean()) - acc) <= 5 * math.sqrt(acc * (1 - acc) / hit.sum()) + 1e-12
    chat = sampler.draw(np.full(1000, sampler.names.index("chat")), rng)
    assert (chat[0] == 2).all() and (chat[1][:, 0] == 0.4).all() and (chat[1][:, 1] == 0.6).all()
    # negative control: the first position's weights do not describe the second position's draws
    assert not close(float(np.mean(conf[:, 1] == 0.3)), 1.0 / 4)


def test_cli_policy_table_plans_while_the_sps_table_times(tmp_path) -> None:
    """--policy-sps-table: alg1 plans on it (a steep table admits no drafts) while --sps-table still times."""
    flat, steep = tmp_path / "flat.json", tmp_path / "steep.json"
    SPSTable((1, 64), (10.0, 9.9), 64).save(flat)
    SPSTable((1, 2), (10.0, 1.0), 64).save(steep)
    stats = stats_file(tmp_path, conditional_acceptance=[0.9, 0.9])

    def row(*extra):
        out = tmp_path / f"out{len(extra)}"
        assert main(["simulate", "--sps-table", str(flat), "--stats", stats, "--users", "1", "--num-requests", "2",
                     "--output-len", "16", "--policies", "alg1", "--no-prefill", "--out-dir", str(out), *extra]) == 0
        return json.loads((out / "simulate.json").read_text())["rows"][0]

    own, planned = row(), row("--policy-sps-table", str(steep))
    assert own["avg_verify_len"] > 1.0 and planned["avg_verify_len"] == 0.0
    # timed by the flat table either way: the first token from the (free) prefill, then 15 one-token steps at 10/s
    assert planned["total_tokens_per_s"] == pytest.approx(16 / 1.5)


def test_per_request_statistics_follow_the_trace_records(tmp_path) -> None:
    """--per-request-stats: request i drafts as trace record i did (one always accepts, one never), in trace order;
    other drafters' records are left out; without --trace it is a one-line error."""
    def record(drafter, accept):  # 4 steps each proposing 2 drafts, all or none accepted
        counts = [[0, 0, 0], [0, 0, 0], [0, 0, 4]] if accept else [[0, 0, 0], [0, 0, 0], [4, 0, 0]]
        return {"drafter": drafter, "dataset": "d", "prompt_tokens": 8, "new_tokens": 12,
                "stats": {"block_size": 2, "counts": counts, "sum_acceptance_length": 12 if accept else 4}}

    trace = tmp_path / "samples.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [record("pld", True), record("other", False),
                                                        record("pld", False)]) + "\n")
    SPSTable((1, 64), (10.0, 10.0), 64).save(tmp_path / "sps.json")
    base = ["simulate", "--sps-table", str(tmp_path / "sps.json"), "--trace", str(trace), "--drafter-name", "pld",
            "--users", "1", "--num-requests", "2", "--policies", "all", "--no-prefill"]
    assert main([*base, "--per-request-stats", "--out-dir", str(tmp_path / "out")]) == 0
    row = json.loads((tmp_path / "out" / "simulate.json").read_text())["rows"][0]
    # request 1 commits 3 tokens per step (11 after its first), request 2 one per step: 4 + 11 steps in all
    assert row["completion_tokens"] == 24 and row["acceptance_length"] == pytest.approx(22 / 15)
    assert main([*base[:3], *base[5:], "--per-request-stats", "--out-dir", str(tmp_path / "o2")]) == 2  # no trace
