"""The noise model (``lit_ddp.derive.noise``) on seeded synthetic samples: known shifts are found, A/A pairs are
called ``same`` at about the chosen rate, correlated steps do not inflate that rate, and the words are seeded."""

import math
import warnings

import numpy as np
import pytest

from lit_ddp.derive import noise

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


def test_too_few_samples_give_their_median_and_no_interval_and_none_give_nan_without_numpy_s_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns on the median of nothing: none is taken
        nothing = noise.median_interval([math.nan])
        assert math.isnan(nothing.estimate) and (nothing.low, nothing.high) == (-math.inf, math.inf)
        for a, b in (([], [1.0] * 10), ([1.0] * 10, []), ([0.0] * 10, [1.0] * 10), ([-1.0] * 10, [1.0] * 10)):
            r = noise.ratio_interval(a, b)  # nothing on a side, or no ratio to a median that is not positive
            assert math.isnan(r.estimate) and (r.low, r.high) == (-math.inf, math.inf), (a, b)
    assert noise.process_spread([]) == 0.0
    assert noise.median_interval([4.0]) == noise.Interval(4.0, -math.inf, math.inf)
    assert noise.median_interval([4.0, 1.0, 2.0, 3.0]) == noise.Interval(2.5, -math.inf, math.inf)
    assert noise.ratio_interval([2.0], [3.0]) == noise.Interval(1.5, -math.inf, math.inf)
    assert noise.ratio_interval([0.5] * 4, [1.0] * 4) == noise.Interval(2.0, -math.inf, math.inf)
    five = [0.4, 0.6, 0.5, 0.55, 0.45]  # MIN_SAMPLES: enough for an interval
    assert noise.median_interval(five).estimate == 0.5 and noise.median_interval(five).high < math.inf
    assert noise.ratio_interval(five, [2 * x for x in five]).low > 0


def test_a_ratio_is_b_s_median_over_a_s_and_can_t_tell_where_a_resampled_median_of_a_is_zero():
    rng = np.random.default_rng(8)
    a, b = rng.normal(0.5, 0.01, 20), rng.normal(1.0, 0.01, 20)  # medians under 1: a ratio of about 2
    r = noise.ratio_interval(a, b)
    assert r.estimate == pytest.approx(np.median(b) / np.median(a)) and 1.9 < r.low < r.estimate < r.high < 2.1
    assert r == noise.ratio_interval(a, b, seed=0) and noise.call(r, null=1.0) == "slower"
    # Uncorrelated steps of 0 and 1 (median 1): a resample with four zeros of the seven has a median of 0
    assert noise.ratio_interval([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0], [2.0] * 7) == noise.Interval(
        2.0, -math.inf, math.inf
    )


def test_student_t_quantiles_for_odd_degrees_of_freedom_and_under_1():
    for confidence, df, table_value in ((0.95, 3, 3.182), (0.95, 5, 2.571), (0.95, 7, 2.365), (0.90, 3, 2.353),
                                        (0.99, 1, 63.657), (0.5, 2, 0.8165), (0.5, 10, 0.6998)):  # fmt: skip
        assert noise.t_quantile(confidence, df) == pytest.approx(table_value, abs=1e-3), (confidence, df)
    assert noise.t_quantile(0.5, 1) == pytest.approx(1.0)  # Cauchy's quartile


def test_runs_too_short_to_tell_fall_back_to_each_side_s_first_run_and_can_t_tell():
    short = [[1.0, 2.0, 3.0], [10.0, 11.0, 12.0]]  # fewer than MIN_SAMPLES steps each: left out
    long = [[5.0] * 40, [6.0] * 40]
    for a, b, estimate in ((short, long, 5.0 - 2.0), (long, short, 2.0 - 5.0), ([], long, math.nan)):
        d = noise.runs_difference_interval(a, b)
        assert (d.low, d.high) == (-math.inf, math.inf), (a, b)
        assert d.estimate == estimate or math.isnan(d.estimate) and math.isnan(estimate), (a, b)
    five = [[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0, 4.0, 5.0, 6.0]]  # MIN_SAMPLES each: kept
    d = noise.runs_difference_interval(five, [[x + 10 * (i + 1) for x in run] for i, run in enumerate(five)])
    assert d.estimate == 15.0 and d.low < 15.0 < d.high < math.inf  # both runs' medians, not the first runs' 10


def test_one_long_run_each_is_the_two_runs_interval_with_every_argument_passed_on():
    rng = np.random.default_rng(9)
    x, y = rng.normal(10, 0.1, 40), rng.normal(10.5, 0.1, 40)  # steady runs: drift well under 0.5 ms
    assert noise.drift(x, y) < 0.2
    assert noise.runs_difference_interval([x], [y]) == noise.difference_interval(x, y, between_runs=True)
    assert noise.runs_difference_interval([x, [1.0, 2.0]], [y], confidence=0.8, seed=3, spread=0.5) == (
        noise.difference_interval(x, y, confidence=0.8, seed=3, between_runs=True, spread=0.5)
    )  # the short run left out


def test_runs_whose_medians_agree_are_as_uncertain_as_their_own_steps_and_seeded():
    rng = np.random.default_rng(10)
    run = list(rng.normal(10, 1, 30))
    a, b = [run, run[::-1]], [run[::-1], run]  # every run's median the same: no spread between runs
    d = noise.runs_difference_interval(a, b)
    assert d.estimate == 0.0 and d.high > 0.2 and d.low == -d.high  # each run's bootstrap, not a width of 0
    assert d == noise.runs_difference_interval(a, b, seed=0) != noise.runs_difference_interval(a, b, seed=1)


def test_the_correlation_time_of_short_and_constant_runs_and_single_precision_samples():
    assert noise.correlation_time([1.0, 2.0, 3.0]) == 1.0  # under 4 steps: nothing to fit
    # centred -1.5, -0.5, 0.5, 1.5: lag-1 r = 1.25 / 5, + (1 + 3 r) / 4 = 0.6875, so (1 + r) / (1 - r) = 5.4
    assert noise.correlation_time([1.0, 2.0, 3.0, 4.0]) == pytest.approx(5.4)
    assert noise.correlation_time([5.0] * 10) == pytest.approx(1.1 / 0.9)  # no variance: r = 0, + 1 / 10
    single = np.random.default_rng(11).normal(10, 1, 40).astype(np.float32)  # as a float32 tensor gives them
    double = single.astype(float)
    assert noise.correlation_time(single) == noise.correlation_time(double)
    assert noise.median_interval(single) == noise.median_interval(double)  # read in double, not rounded to float


def test_a_run_s_drift_is_its_halves_medians_apart_and_one_step_has_none():
    ramp = [0.0] * 6 + [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # halves' medians 0 and 3.5
    assert noise.drift(ramp, [5.0] * 10) == noise.drift([5.0] * 10, ramp) == 3.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no median of an empty half is taken
        assert noise.drift([7.0], [5.0] * 10) == 0.0
        nothing = noise.difference_interval([], [1.0] * 10)
        assert math.isnan(nothing.estimate) and math.isinf(nothing.low)
        assert math.isnan(noise.difference_interval([1.0] * 10, []).estimate)
    assert noise.difference_interval([2.0], [3.0]) == noise.Interval(1.0, -math.inf, math.inf)
    five = noise.difference_interval([1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0, 7.0])  # MIN_SAMPLES
    assert five.estimate == 2.0 and -math.inf < five.low < 2.0 < five.high < math.inf
    rng = np.random.default_rng(5)
    drifting = np.concatenate([rng.normal(10, 0.2, 20), rng.normal(13, 0.2, 20)])
    steady = rng.normal(10, 0.2, 40)
    within = noise.difference_interval(drifting, steady)
    apart = noise.difference_interval(drifting, steady, between_runs=True)  # A is the run that drifted
    assert apart.low == pytest.approx(within.low - noise.drift(drifting, steady)) and noise.drift(drifting, steady) > 2


def test_confidence_is_strictly_between_0_and_1_and_a_call_needs_more_than_the_floor():
    for confidence in (0.0, 1.0):
        with pytest.raises(ValueError, match=f"confidence={confidence}"):
            noise.median_interval([1.0] * 10, confidence=confidence)
    beyond = noise.Interval(2.0, 1.0, 3.0)  # excludes 0
    assert noise.call(beyond, min_effect=2.0) == "same"  # exactly at the floor: not more than it
    assert noise.call(beyond, min_effect=1.99) == "slower"
