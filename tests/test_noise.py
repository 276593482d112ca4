"""The noise model (``lit_ddp.analysis.noise``) on seeded synthetic samples: known shifts are found, A/A pairs are
called ``same`` at about the chosen rate, correlated steps do not inflate that rate, and the words are seeded."""

import math

import numpy as np
import pytest

from lit_ddp.analysis import noise

pytestmark = pytest.mark.timeout(60)


def ar1(rng: np.random.Generator, n: int, phi: float, centre: float = 10.0) -> np.ndarray:
    """``n`` steps of an AR(1) series of unit innovations: each step ``phi`` like the one before."""
    e = rng.normal(size=n)
    x = np.empty(n)
    x[0] = e[0] / math.sqrt(1 - phi**2)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + e[i]
    return centre + x


def false_calls(phi: float, pairs: int = 100, n: int = 40) -> float:
    rng = np.random.default_rng(7)
    calls = [noise.call(noise.difference_interval(ar1(rng, n, phi), ar1(rng, n, phi), seed=i)) for i in range(pairs)]
    return sum(c != "same" for c in calls) / pairs


def test_an_interval_holds_its_estimate_and_says_what_it_excludes():
    i = noise.median_interval([5.0, 1.0, 3.0, 2.0, 4.0, 3.0])
    assert i.low <= i.estimate == 3.0 <= i.high
    assert i.excludes(i.high + 1) and i.excludes(i.low - 1) and not i.excludes(i.estimate)


def test_known_shifts_are_found_in_both_directions_with_their_size():
    rng = np.random.default_rng(0)
    a, b = rng.normal(10, 1, 40), rng.normal(11.5, 1, 40)
    d = noise.difference_interval(a, b)
    assert noise.call(d) == "slower" and d.low > 0 and d.low < 1.5 < d.high
    assert noise.call(noise.difference_interval(b, a)) == "faster"
    r = noise.ratio_interval(a, b)
    assert noise.call(r, null=1.0) == "slower" and r.low > 1.0
    assert noise.call(d, min_effect=5.0) == "same"  # beyond the noise but under the floor


def test_a_a_pairs_are_called_same_at_about_the_chosen_rate():
    assert false_calls(phi=0.0) <= 0.08


@pytest.mark.parametrize("phi", [0.5, 0.8])
def test_steps_correlated_in_time_widen_the_interval_instead_of_making_false_calls(phi):
    assert false_calls(phi) <= 0.08
    rng = np.random.default_rng(3)
    x = ar1(rng, 50, phi)
    assert noise.correlation_time(x) > 1.5
    white = rng.permutation(x)  # the same values, their order shuffled: less to correct for
    assert noise.median_interval(x).high - noise.median_interval(x).low > (
        noise.median_interval(white).high - noise.median_interval(white).low
    )


def test_the_same_samples_give_the_same_interval_and_too_few_give_none():
    rng = np.random.default_rng(1)
    a, b = rng.normal(10, 1, 30), rng.normal(10, 1, 30)
    assert noise.difference_interval(a, b, seed=4) == noise.difference_interval(a, b, seed=4)
    few = noise.difference_interval([1.0, 2.0], [9.0, 9.5])
    assert few.estimate == pytest.approx(7.75) and math.isinf(few.low) and noise.call(few) == "same"
    assert noise.call(noise.ratio_interval([0.0] * 10, [1.0] * 10), null=1.0) == "same"  # no ratio to a zero


def test_a_family_of_comparisons_asks_more_of_each_and_bad_input_is_refused():
    assert noise.family_confidence(0.95, 1) == pytest.approx(0.95)
    assert noise.family_confidence(0.95, 10) == pytest.approx(0.995)
    rng = np.random.default_rng(2)
    a, b = rng.normal(10, 1, 40), rng.normal(10.6, 1, 40)
    wide = noise.difference_interval(a, b, confidence=noise.family_confidence(0.95, 20))
    narrow = noise.difference_interval(a, b)
    assert wide.low < narrow.low and wide.high > narrow.high
    with pytest.raises(ValueError, match="comparisons=0"):
        noise.family_confidence(0.95, 0)
    with pytest.raises(ValueError, match="confidence=1.5"):
        noise.median_interval([1.0] * 10, confidence=1.5)
    with pytest.raises(ValueError, match="min_effect=-1"):
        noise.call(narrow, min_effect=-1)
