"""How the tool writes amounts: units chosen by magnitude, so a small model shows FLOP, not 0.000 GFLOP, and an
82 kB bucket's all-reduce on CPU 82.0 kB/s, not 0.00 GB/s."""

import math

import pytest

from lit_ddp.allreduce_probe import format_probe
from lit_ddp.formatting import fmt_bandwidth, fmt_ms, fmt_si, table


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (64, "FLOP", "64 FLOP"),
        (16_640, "FLOP", "16.6 kFLOP"),
        (389_000_000, "FLOP", "389.0 MFLOP"),
        (1.074e9, "FLOP", "1.07 GFLOP"),
        (2.5e13, "FLOP/s", "25.0 TFLOP/s"),
        (469.9e6, "B", "469.9 MB"),
        (33_280, "B", "33.3 kB"),
        (0.5, "B/s", "0.50 B/s"),
    ],
)
def test_the_prefix_follows_the_magnitude(value, unit, text):
    assert fmt_si(value, unit) == text


@pytest.mark.parametrize(
    ("gb_per_s", "text"),
    [(82e-6, "82.0 kB/s"), (0.0253, "25.3 MB/s"), (0.5144, "514 MB/s"), (0.9996, "1.00 GB/s"), (1.234, "1.23 GB/s"),
     (450, "450 GB/s"), (math.nan, "-")],
)  # fmt: skip
def test_bandwidth_follows_the_magnitude_to_three_significant_figures(gb_per_s, text):
    assert fmt_bandwidth(gb_per_s) == text


def test_the_probe_table_and_its_fit_write_bandwidth_by_magnitude():
    record = {"backend": "gloo", "world_size": 2, "dtype": "float32", "warmup": 1, "iters": 3,
              "rows": [{"nbytes": 1024, "ms": 0.0125, "algbw_gbps": 0.08192, "busbw_gbps": 0.08192},
                       {"nbytes": 8_388_608, "ms": 4.0, "algbw_gbps": 2.097152, "busbw_gbps": 2.097152}],
              "fit": {"hop_latency_us": 12.0, "busbw_gbps": 2.1}}  # fmt: skip
    lines = format_probe(record).splitlines()
    assert lines[1].split() == ["size", "(B)", "time", "(ms)", "algbw", "busbw"]
    assert lines[2].split() == ["1,024", "0.013", "81.9", "MB/s", "81.9", "MB/s"]
    assert lines[3].split() == ["8,388,608", "4.000", "2.10", "GB/s", "2.10", "GB/s"]
    assert lines[4] == "fit: t = 2(n-1) x 12.0 us + 2(n-1)/n x S / 2.10 GB/s (n = 2)"


@pytest.mark.parametrize(
    ("ms", "text"),
    [(999.99, "999.99 ms"), (999.996, "1.00 s"), (1000, "1.00 s"), (1000.5, "1.00 s"), (123_456, "123.46 s")],
)
def test_milliseconds_turn_to_seconds_at_1000(ms, text):
    assert fmt_ms(ms) == text


@pytest.mark.parametrize(
    ("gb_per_s", "text"),
    [(82e-9, "82.0 B/s"), (0.01, "10.0 MB/s"), (0.0105, "10.5 MB/s"), (0.1, "100 MB/s"), (1000, "1.00 TB/s"),
     (2500, "2.50 TB/s"), (0.03125, "31.2 MB/s")],
)  # fmt: skip
def test_bandwidth_at_the_edges_of_its_prefixes_and_its_figures(gb_per_s, text):
    """Exactly 10 and 100 of a unit take one and no decimals; 1000 GB/s is 1.00 TB/s; under 1 kB/s no prefix; an
    exact half of the third figure (31.25 MB/s) rounds as Python's format rounds the byte rate itself."""
    assert fmt_bandwidth(gb_per_s) == text


def test_the_table_pads_names_left_and_figures_right():
    assert table(("name", "ms"), [("a", "1.5"), ("bbbb", "12.25")]).splitlines() == [
        "name     ms",
        "a       1.5",
        "bbbb  12.25",
    ]
    assert table(("n", "ms"), [("abc", "1")], left=0).splitlines() == ["  n  ms", "abc   1"]


def test_a_row_with_more_cells_than_the_header_is_an_error():
    with pytest.raises(ValueError):
        table(("a", "b"), [("1", "2", "3")])
