"""The noise model every conclusion rests on: an interval for a median, and for the difference or ratio of two
medians, from per-step samples in time order; and the one word ("slower", "faster", "same") an interval allows.

    from lit_ddp.derive import noise
    noise.call(noise.difference_interval(run_a_forward_ms, run_b_forward_ms))   # "slower", "faster" or "same"

A bootstrap of the median whose spread is widened by the samples' correlation time: steps next to each other
are alike (a busy core slows a run of them), so n correlated steps tell as much as n / tau independent ones.
Two runs made apart differ by more than their steps show (other processes, another share of the machine): one
run per side widens the interval by what the records show of that (``drift``, ``process_spread``); several
runs per side take the runs' medians as the samples (``runs_difference_interval``, a t interval).
Seeded: the same samples give the same interval, so the same record gives the same words. The method, its
assumptions, its measured false-call rate and what "same" means: docs/noise.md.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
MIN_SAMPLES = 5  # below this no interval is drawn: it is (-inf, inf), and every call is "same"


@dataclass(frozen=True)
class Interval:
    """An estimate with its two-sided interval (``low <= estimate <= high``, or infinite bounds: can't tell)."""

    estimate: float
    low: float
    high: float

    def excludes(self, value: float) -> bool:
        return value < self.low or value > self.high


def correlation_time(samples: Sequence[float]) -> float:
    """How many steps' worth of samples count as one independent one: the integrated autocorrelation time of an
    AR(1) fit, ``(1 + r) / (1 - r)``, with ``r`` the lag-1 autocorrelation plus Kendall's bias correction, kept
    within [0, 0.9] (1 for uncorrelated steps, at most 19)."""
    x = np.asarray(samples, dtype=float)
    n = len(x)
    if n < 4:
        return 1.0
    centred = x - x.mean()
    variance = float(centred @ centred)
    r = float(centred[:-1] @ centred[1:]) / variance if variance else 0.0
    r = min(max(r + (1 + 3 * r) / n, 0.0), 0.9)
    return (1 + r) / (1 - r)


def _medians(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``RESAMPLES`` bootstrap medians of ``x``, spread about the median by the square root of the samples'
    correlation time: as many as ``n / tau`` independent samples would spread them."""
    estimate = float(np.median(x))
    replicates = np.median(x[rng.integers(0, len(x), size=(RESAMPLES, len(x)))], axis=1)
    return estimate + math.sqrt(correlation_time(x)) * (replicates - estimate)


def _clean(samples: Sequence[float]) -> np.ndarray:
    x = np.asarray(samples, dtype=float)
    return x[~np.isnan(x)]


def _interval(estimate: float, replicates: np.ndarray, confidence: float) -> Interval:
    _check(confidence)
    tail = (1 - confidence) / 2
    low, high = np.quantile(replicates, [tail, 1 - tail])
    return Interval(estimate, min(float(low), estimate), max(float(high), estimate))


def _check(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"`confidence={confidence!r}` must be between 0 and 1")


def _unknown(estimate: float) -> Interval:
    return Interval(estimate, -math.inf, math.inf)


def median_interval(samples: Sequence[float], *, confidence: float = 0.95, seed: int = 0) -> Interval:
    """The median of ``samples`` (per-step, in time order) with its ``confidence`` interval."""
    _check(confidence)
    x = _clean(samples)
    if len(x) == 0:
        return _unknown(math.nan)
    estimate = float(np.median(x))
    if len(x) < MIN_SAMPLES:
        return _unknown(estimate)
    return _interval(estimate, _medians(x, np.random.default_rng(seed)), confidence)


def difference_interval(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = 0.95,
    seed: int = 0,
    between_runs: bool = False,
    spread: float = 0.0,
) -> Interval:
    """``median(b) - median(a)`` with its ``confidence`` interval; ``a`` and ``b`` resampled independently (two
    runs, or two ranks, each per-step in time order). ``between_runs``: ``a`` and ``b`` are two runs made apart, so
    the machine may have drifted between them, and two processes of one job differ: the interval is widened on both
    sides by the larger of ``drift(a, b)`` and ``spread`` (how far apart two processes of one job were seen, for
    example the ranks' medians: ``process_spread``)."""
    _check(confidence)
    x, y = _clean(a), _clean(b)
    if len(x) == 0 or len(y) == 0:
        return _unknown(math.nan)
    estimate = float(np.median(y) - np.median(x))
    if min(len(x), len(y)) < MIN_SAMPLES:
        return _unknown(estimate)
    rng = np.random.default_rng(seed)
    found = _interval(estimate, _medians(y, rng) - _medians(x, rng), confidence)
    if not between_runs:
        return found
    if spread < 0:
        raise ValueError(f"`spread={spread!r}` must be >= 0")
    allowance = max(drift(x, y), spread)
    return Interval(estimate, found.low - allowance, found.high + allowance)


def drift(a: Sequence[float], b: Sequence[float]) -> float:
    """How far the machine may move a run's median between two runs: the larger of the two runs' own drift, the
    median of its second half less that of its first (a shared machine's load comes and goes over seconds, as
    long as a short run: two 40-step runs of one job were seen 5.6x apart here)."""

    def own(x: np.ndarray) -> float:
        half = len(x) // 2
        return abs(float(np.median(x[half:]) - np.median(x[:half]))) if half else 0.0

    return max(own(_clean(a)), own(_clean(b)))


def process_spread(medians: Sequence[float]) -> float:
    """How far apart two processes of one job were seen: the range of their medians (a run's ranks are separate
    processes of one job, each with its own placement, caches and share of the machine); 0 with fewer than two."""
    x = _clean(medians)
    return float(x.max() - x.min()) if len(x) > 1 else 0.0  # len(x) >= 1 is equivalent: one median's range is 0


def runs_difference_interval(
    a_runs: Sequence[Sequence[float]],
    b_runs: Sequence[Sequence[float]],
    *,
    confidence: float = 0.95,
    seed: int = 0,
    spread: float = 0.0,
) -> Interval:
    """The mean of ``b_runs``' medians less the mean of ``a_runs``' (several runs of each side, each run's samples
    per step in time order), with its ``confidence`` interval: a two-sample t interval on the runs' medians, their
    variance pooled over both sides (each run a draw of the machine's and the processes' conditions) and at least
    what each run's own steps show (its bootstrap, as ``median_interval``'s), with ``runs - 2`` degrees of freedom.
    One run on each side: ``difference_interval(between_runs=True, spread=spread)``, which cannot see a whole run
    moved by the machine. Runs with fewer than ``MIN_SAMPLES`` samples are left out; too few runs: can't tell."""
    _check(confidence)
    sides = [[x for x in map(_clean, runs) if len(x) >= MIN_SAMPLES] for runs in (a_runs, b_runs)]
    if not sides[0] or not sides[1]:
        # A side's first run is shorter than MIN_SAMPLES (or there is none): difference_interval can't tell.
        firsts = [_clean(runs[0]) if len(runs) else np.array([]) for runs in (a_runs, b_runs)]
        return difference_interval(*firsts, confidence=confidence, seed=seed, between_runs=True, spread=spread)
    if len(sides[0]) == len(sides[1]) == 1:
        return difference_interval(*sides[0], *sides[1], confidence=confidence, seed=seed, between_runs=True,
                                   spread=spread)  # fmt: skip
    rng = np.random.default_rng(seed)
    medians = [np.array([np.median(x) for x in side]) for side in sides]
    within = [float(np.mean([np.var(_medians(x, rng)) for x in side])) for side in sides]
    df = len(sides[0]) + len(sides[1]) - 2
    between = sum(float(np.sum((m - m.mean()) ** 2)) for m in medians) / df
    # zip(strict=...) is equivalent here: medians and within are built from the two sides alike
    se = math.sqrt(sum(max(between, v) / len(m) for m, v in zip(medians, within, strict=True)))
    estimate = float(medians[1].mean() - medians[0].mean())
    half = t_quantile(confidence, df) * se
    return Interval(estimate, estimate - half, estimate + half)


def t_quantile(confidence: float, df: int) -> float:
    """``t`` with ``P(|T| < t) = confidence`` for Student's t with ``df`` (>= 1) degrees of freedom: its exact
    distribution function (Abramowitz and Stegun 26.7.3-4) inverted by bisection."""
    _check(confidence)
    if df < 1:
        raise ValueError(f"`df={df!r}` must be >= 1")

    def inside(t: float) -> float:  # P(|T| < t)
        theta = math.atan(t / math.sqrt(df))
        c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
        start = 2 if df % 2 else 1
        for k in range(start, df - 1, 2):  # k and df - 1 differ in parity: a stop of df - 2 ends at the same k
            term *= c2 * k / (k + 1)
            total += term
        if df % 2 == 0:
            return math.sin(theta) * total
        # An odd df only.
        return 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0))

    # The bracket only has to hold t.
    low, high = 0.0, 1.0
    while inside(high) < confidence:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if inside(mid) < confidence else (low, mid)
    return (low + high) / 2


def ratio_interval(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, seed: int = 0) -> Interval:
    """``median(b) / median(a)`` with its ``confidence`` interval (times: > 1 is b slower); can't tell (infinite
    bounds) where a resampled median of ``a`` is not positive."""
    _check(confidence)
    x, y = _clean(a), _clean(b)
    if len(x) == 0 or len(y) == 0 or np.median(x) <= 0:
        return _unknown(math.nan)
    estimate = float(np.median(y) / np.median(x))
    if min(len(x), len(y)) < MIN_SAMPLES:
        return _unknown(estimate)
    rng = np.random.default_rng(seed)
    mb, ma = _medians(y, rng), _medians(x, rng)
    if (ma <= 0).any():
        return _unknown(estimate)
    return _interval(estimate, mb / ma, confidence)


def family_confidence(confidence: float, comparisons: int) -> float:
    """The confidence each of ``comparisons`` intervals needs for all of them to hold together at ``confidence``
    (Bonferroni: the chance of any false call is at most the sum of each one's)."""
    _check(confidence)
    if comparisons < 1:
        raise ValueError(f"`comparisons={comparisons!r}` must be >= 1")
    return 1 - (1 - confidence) / comparisons


def call(interval: Interval, *, null: float = 0.0, min_effect: float = 0.0) -> str:
    """``"slower"`` (above ``null``) or ``"faster"`` (below it) when the interval excludes ``null`` and the
    estimate is more than ``min_effect`` from it; ``"same"`` otherwise: within the noise, or too small to matter."""
    if min_effect < 0:
        raise ValueError(f"`min_effect={min_effect!r}` must be >= 0")
    effect = interval.estimate - null
    if not interval.excludes(null) or not abs(effect) > min_effect:
        return "same"
    return "slower" if effect > 0 else "faster"  # effect >= 0 is equivalent: an effect of 0 is "same" above
