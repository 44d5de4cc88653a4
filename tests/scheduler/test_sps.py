"""SPS cost table: SGLang JSON format, floor-step lookup, validation, profiling."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.errors import BadFileError
from dspark.scheduler.sps import UNLIMITED_BATCH_TOKENS, SPSTable, linear_between, profile_sps

TABLE = SPSTable((1, 8, 16), (50.0, 40.0, 25.0), 24)


# ------------------------------------------------------------------- json
def test_json_round_trip_in_sglang_format() -> None:
    text = TABLE.to_json()
    assert json.loads(text) == {
        "sample_batch_tokens": [1, 8, 16],
        "sample_steps_per_sec": [50.0, 40.0, 25.0],
        "max_batch_tokens": 24,
    }
    assert SPSTable.from_json(text) == TABLE


def test_reads_a_table_written_by_sglang() -> None:
    text = '{"sample_batch_tokens":[8,16,32],"sample_steps_per_sec":[61.5,60,41.25],"max_batch_tokens":64}'
    table = SPSTable.from_json(text)
    assert table.sample_batch_tokens == (8, 16, 32)
    assert table.sample_steps_per_sec == (61.5, 60.0, 41.25)
    assert table.max_batch_tokens == 64


def test_linear_between_fills_every_count_and_keeps_the_measured_points() -> None:
    grid, values = linear_between((2, 4, 8), (10.0, 20.0, 0.5))
    assert grid == (2, 3, 4, 5, 6, 7, 8)
    # a slow reference: the value on the segment between the measured neighbours
    expected = [10.0, 15.0, 20.0] + [20.0 + (0.5 - 20.0) * (x - 4) / 4 for x in (5, 6, 7)] + [0.5]
    assert values == pytest.approx(expected, abs=1e-12)
    assert (values[0], values[2], values[6]) == (10.0, 20.0, 0.5)  # exactly as measured
    assert linear_between((3,), (1.5,)) == ((3,), (1.5,))
    with pytest.raises(ValueError, match="increasing"):
        linear_between((4, 2), (1.0, 2.0))


def test_filled_table_is_linear_in_step_time_between_samples() -> None:
    table = SPSTable((1, 8, 16), (50.0, 40.0, 25.0), 24).filled()
    assert table.sample_batch_tokens == tuple(range(1, 17)) and table.max_batch_tokens == 24
    for b in (1, 8, 16):
        assert table.sps(b) == TABLE.sps(b)
    # 12 batch tokens: halfway between 1/40 s and 1/25 s (step time, not steps per second, is linear)
    assert table.sps(12) == pytest.approx(1.0 / (0.5 / 40.0 + 0.5 / 25.0))
    assert all(a >= b for a, b in zip(table.sample_steps_per_sec, table.sample_steps_per_sec[1:]))
    assert table.sps(20) == table.sps(16) and table.sps(25) == 0.0  # floor step beyond the last, 0 past capacity


def test_save_and_load(tmp_path) -> None:
    path = tmp_path / "dspark_sps.json"
    TABLE.save(path)
    assert SPSTable.load(path) == TABLE
    with pytest.raises(BadFileError, match="does not exist"):  # a DSparkError: one line from the CLI
        SPSTable.load(tmp_path / "missing.json")
    (tmp_path / "unsorted.json").write_text(json.dumps({**TABLE.to_dict(), "sample_batch_tokens": [1, 16, 8]}))
    with pytest.raises(BadFileError, match="unsorted.json: sample_batch_tokens must be strictly increasing"):
        SPSTable.load(tmp_path / "unsorted.json")


# ----------------------------------------------------------------- lookup
@pytest.mark.parametrize(
    "batch_tokens, expected",
    [
        (0, 50.0),  # below the first sample: the first value
        (1, 50.0),
        (7, 50.0),  # floor step
        (8, 40.0),
        (15, 40.0),
        (16, 25.0),
        (24, 25.0),  # up to capacity: the last value
        (25, 0.0),  # beyond max_batch_tokens: no capacity
        (10_000, 0.0),
    ],
)
def test_floor_lookup(batch_tokens: int, expected: float) -> None:
    assert TABLE.sps(batch_tokens) == expected


def test_tensor_lookup_matches_scalar_lookup() -> None:
    batch_tokens = torch.arange(0, 40)
    expected = torch.tensor([TABLE.sps(int(b)) for b in batch_tokens], dtype=torch.float64)
    assert torch.equal(TABLE.sps_tensor(batch_tokens), expected)
    assert torch.equal(TABLE.sps_tensor(batch_tokens.reshape(4, 10)), expected.reshape(4, 10))


def test_flat_table_is_verify_all_fallback() -> None:
    flat = SPSTable.flat()
    assert flat.is_flat and not TABLE.is_flat
    assert flat.to_dict() == {
        "sample_batch_tokens": [1],
        "sample_steps_per_sec": [1.0],
        "max_batch_tokens": UNLIMITED_BATCH_TOKENS,
    }
    assert flat.sps(1) == flat.sps(123_456) == 1.0
    assert SPSTable.flat(max_batch_tokens=32).sps(33) == 0.0


# ------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "tokens, sps, max_tokens, message",
    [
        ((), (), 1, "at least one sample"),
        ((1, 2), (1.0,), 2, "equal length"),
        ((1, 4, 4), (1.0, 1.0, 1.0), 4, "strictly increasing"),
        ((4, 2), (1.0, 1.0), 4, "strictly increasing"),
        ((0, 2), (1.0, 1.0), 4, "integers >= 1"),
        ((1.5, 2), (1.0, 1.0), 4, "integers >= 1"),
        ((1, 2), (1.0, 0.0), 4, "finite positive"),
        ((1, 2), (1.0, float("nan")), 4, "finite positive"),
        ((1, 2), (1.0, -3.0), 4, "finite positive"),
        ((1, 8), (1.0, 1.0), 7, "max_batch_tokens"),
    ],
)
def test_invalid_tables_raise(tokens, sps, max_tokens, message) -> None:
    with pytest.raises(ValueError, match=message):
        SPSTable(tokens, sps, max_tokens)


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "must be an object"),
        ('{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0]}', "missing \\['max_batch_tokens'\\]"),
        (
            '{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0],"max_batch_tokens":1,"gpu":"h100"}',
            "unknown \\['gpu'\\]",
        ),
        ('{"sample_batch_tokens":1,"sample_steps_per_sec":[1.0],"max_batch_tokens":1}', "must be a list"),
        (
            '{"bias_seconds":0.01,"bs_probes":[1],"alpha_seconds":[0.0],'
            '"m_probes":[1],"theta_seconds":[0.0]}',
            "additive",
        ),
    ],
)
def test_invalid_json_raises(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SPSTable.from_json(text)


# -------------------------------------------------------------- profiling
class FakeClock:
    """A clock that only moves when the fake step function says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_profile_sps_with_fake_clock() -> None:
    clock = FakeClock()
    calls: list[int] = []
    # step time = 0.01 s per token, except one slow outlier per grid point (the 2nd
    # timed call) and a very slow first (warm-up) call: the median must ignore both
    def step_fn(batch_tokens: int) -> None:
        done = sum(1 for b in calls if b == batch_tokens)
        calls.append(batch_tokens)
        cost = 0.01 * batch_tokens
        if done == 0:
            cost *= 100  # warm-up: compilation, allocation
        elif done == 2:
            cost *= 10  # an outlier among the timed repeats
        clock.now += cost

    table = profile_sps(step_fn, [16, 1, 4], repeats=5, warmup=1, clock=clock)
    assert table.sample_batch_tokens == (1, 4, 16)  # sorted
    assert table.sample_steps_per_sec == pytest.approx((100.0, 25.0, 6.25))  # 1 / median
    assert table.max_batch_tokens == 16
    assert calls == [1] * 6 + [4] * 6 + [16] * 6  # warm-up + repeats, grid in order


def test_profile_sps_even_repeats_and_capacity() -> None:
    clock = FakeClock()
    times = iter([0.1, 0.3, 0.2, 0.4])  # median of 4 = (0.2 + 0.3) / 2

    def step_fn(batch_tokens: int) -> None:
        clock.now += next(times)

    table = profile_sps(step_fn, [8], repeats=4, warmup=0, max_batch_tokens=32, clock=clock)
    assert table.sample_steps_per_sec == pytest.approx((4.0,))
    assert table.max_batch_tokens == 32


@pytest.mark.parametrize(
    "grid, kwargs, message",
    [
        ([], {}, "empty"),
        ([0, 4], {}, ">= 1"),
        ([4, 4], {}, "duplicates"),
        ([4], {"repeats": 0}, "repeats"),
    ],
)
def test_profile_sps_rejects_bad_arguments(grid, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        profile_sps(lambda b: None, grid, clock=FakeClock(), **kwargs)


def test_profile_sps_rejects_a_clock_that_does_not_move() -> None:
    with pytest.raises(ValueError, match="too coarse"):
        profile_sps(lambda b: None, [1], clock=FakeClock())
