"""How the tool writes amounts: units chosen by magnitude, so a small model shows FLOP, not 0.000 GFLOP."""

import pytest

from lit_ddp.analysis.tables import fmt_si


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
