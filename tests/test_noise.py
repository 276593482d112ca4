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


def test_two_runs_made_apart_allow_for_the_drift_each_shows_within_itself():
    rng = np.random.default_rng(5)
    steady = rng.normal(10, 0.2, 40)
    drifting = np.concatenate([rng.normal(10, 0.2, 20), rng.normal(13, 0.2, 20)])  # the load rose mid-run
    assert noise.drift(steady, drifting) == pytest.approx(3.0, abs=0.3)
    within = noise.difference_interval(steady, drifting)
    apart = noise.difference_interval(steady, drifting, between_runs=True)
    assert apart.estimate == within.estimate and apart.low == pytest.approx(within.low - noise.drift(steady, drifting))
    later = rng.normal(12, 0.2, 40)  # a third run, made when the load was up: the same job
    assert noise.call(noise.difference_interval(steady, later, between_runs=True)) == "slower"  # no run drifted
    assert noise.call(noise.difference_interval(drifting, later, between_runs=True)) == "same"


def runs_with_offsets(rng: np.random.Generator, k: int, shift: float = 0.0) -> list[np.ndarray]:
    """``k`` runs of 40 correlated steps, each run moved as a whole by its own draw (sd 1: the machine and the
    processes of that run), ``shift`` on top."""
    return [ar1(rng, 40, 0.5, centre=10 + shift + rng.normal(0, 1.0)) for _ in range(k)]


def test_student_t_quantiles_are_the_tables():
    for confidence, df, table_value in ((0.95, 1, 12.706), (0.95, 2, 4.303), (0.95, 4, 2.776), (0.99, 10, 3.169)):
        assert noise.t_quantile(confidence, df) == pytest.approx(table_value, abs=1e-3)
    assert noise.t_quantile(0.95, 10_000) == pytest.approx(1.960, abs=1e-3)
    with pytest.raises(ValueError, match="df=0"):
        noise.t_quantile(0.95, 0)


def test_several_runs_per_side_allow_for_runs_that_move_as_a_whole():
    rng = np.random.default_rng(12)
    trials = 150
    several = [noise.call(noise.runs_difference_interval(runs_with_offsets(rng, 3), runs_with_offsets(rng, 3),
                                                         seed=i)) for i in range(trials)]  # fmt: skip
    one = [noise.call(noise.difference_interval(*runs_with_offsets(rng, 2), between_runs=True, seed=i))
           for i in range(trials)]  # fmt: skip
    assert sum(c != "same" for c in several) / trials <= 0.08  # A/A with a between-run offset: same
    assert sum(c != "same" for c in one) / trials > 0.1  # one run per side cannot see the offset: why it says so
    found = [noise.runs_difference_interval(runs_with_offsets(rng, 3), runs_with_offsets(rng, 3, shift=5.0), seed=i)
             for i in range(40)]  # fmt: skip
    assert sum(noise.call(d) == "slower" for d in found) >= 36  # a known shift of 5 between-run sds is found
    assert sum(d.low < 5.0 < d.high for d in found) >= 36  # and its interval holds it


def test_several_runs_take_the_mean_of_their_medians_and_one_run_each_falls_back():
    a = [[1.0, 2.0, 3.0, 2.0, 2.0, 2.0], [4.0, 4.0, 5.0, 4.0, 4.0, 4.0]]
    b = [[6.0] * 6, [7.0, 7.0, 8.0, 7.0, 7.0, 7.0]]
    d = noise.runs_difference_interval(a, b)
    assert d.estimate == pytest.approx((6 + 7) / 2 - (2 + 4) / 2)
    half = noise.t_quantile(0.95, 2) * math.sqrt(((2 - 3) ** 2 + (4 - 3) ** 2 + 2 * 0.5**2) / 2 * (1 / 2 + 1 / 2))
    assert d.high - d.estimate == pytest.approx(half)  # the pooled variance of the runs' medians, t with 2 df
    x, y = np.arange(40.0), np.arange(40.0) + 1
    assert noise.runs_difference_interval([x], [y], spread=3.0) == noise.difference_interval(
        x, y, between_runs=True, spread=3.0
    )
    assert noise.process_spread([2.0, 5.0, 3.0]) == 3.0 and noise.process_spread([2.0]) == 0.0
    with pytest.raises(ValueError, match="spread=-1"):
        noise.difference_interval(x, y, between_runs=True, spread=-1.0)


def test_one_run_per_side_allows_for_how_far_the_job_s_processes_were_seen_apart():
    rng = np.random.default_rng(6)
    a, b = rng.normal(10, 0.1, 40), rng.normal(11, 0.1, 40)  # 1 ms apart, far beyond either run's steps
    assert noise.call(noise.difference_interval(a, b, between_runs=True)) == "slower"
    assert noise.call(noise.difference_interval(a, b, between_runs=True, spread=1.5)) == "same"
