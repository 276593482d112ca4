"""How the tool writes amounts: units chosen by magnitude, so a small model shows FLOP, not 0.000 GFLOP, and an
82 kB bucket's all-reduce on CPU 82.0 kB/s, not 0.00 GB/s."""

import math

import pytest

from lit_ddp.allreduce_probe import format_probe
from lit_ddp.analysis.tables import fmt_bandwidth, fmt_si


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
