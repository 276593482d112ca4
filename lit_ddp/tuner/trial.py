"""What one configuration measured (``Trial``: every timed step, in time order), and the noise model's word on two
configurations measured in the same interleaved rounds (``Comparison``). Two configurations that differ only in
the optimizer's implementation run the same forward, backward and all-reduce: their difference is the update's,
so it is judged on the update phase's own samples, where the rest of the step's noise does not drown it.

    python -m lit_ddp.tune --devices 2        # every "faster" the tuner prints is a compare() here

Nothing here decides by a rule of its own: intervals and words come from ``lit_ddp.derive.noise`` (docs/noise.md).
"""

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from lit_ddp.derive import noise
from lit_ddp.records import phases
from lit_ddp.tuner.knobs import Knobs

# A change that may save under 2% of the step is not worth a line of config: "same" unless its whole interval is
# beyond 2%.
MIN_GAIN = 0.02


@dataclass
class Trial:
    """What one configuration measured: every timed step (ms, the slowest rank's) in time order over its rounds,
    each round's median, and what it holds."""

    knobs: Knobs
    samples_ms: list[float] = field(default_factory=list)
    rounds_ms: list[float] = field(default_factory=list)
    ddp_bytes: Optional[int] = None  # DDP's own memory from the live objects (parameters, gradients, buckets, state)
    peak_bytes: Optional[int] = None  # the caching allocator's peak over the trial (CUDA only)
    loss: Optional[float] = None  # the loss of the trial's last step
    max_dw: Optional[float] = None  # max |w - w_yours| after the same steps from the same start
    in_sync: bool = True  # every rank holds rank 0's weights at the end of every round
    seconds: float = 0.0  # wall time of all its rounds
    update_ms: list[float] = field(default_factory=list)  # each step's ``optimizer.step()`` alone, as samples_ms

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else math.nan

    def interval(self, confidence: float = 0.95) -> noise.Interval:
        """The median step with its interval (the noise model's, over every timed step)."""
        return noise.median_interval(self.samples_ms, confidence=confidence)

    def absorb(self, more: "Trial") -> None:
        """Adds ``more``'s rounds (the same knobs, measured later) to this trial."""
        self.samples_ms += more.samples_ms
        self.update_ms += more.update_ms
        self.rounds_ms += more.rounds_ms
        self.seconds += more.seconds
        self.loss, self.ddp_bytes, self.peak_bytes = more.loss, more.ddp_bytes, more.peak_bytes
        self.in_sync = self.in_sync and more.in_sync
        if more.max_dw is not None:
            self.max_dw = max(self.max_dw or 0.0, more.max_dw)

    def holds_less(self, other: "Trial") -> bool:
        return self.ddp_bytes is not None and other.ddp_bytes is not None and self.ddp_bytes < other.ddp_bytes


@dataclass(frozen=True)
class Comparison:
    """``after`` against ``before``, measured in the same interleaved rounds: their median steps, the difference
    judged (ms, after - before: the step's, or the update's for an optimizer change) with its interval, the step's
    speedup (before / after) that interval allows, and the noise model's word for ``after``: faster, slower or
    same."""

    before_ms: float
    after_ms: float
    speedup: noise.Interval
    word: str
    difference: noise.Interval = noise.Interval(math.nan, -math.inf, math.inf)
    phase: str = phases.STEP  # phases.UPDATE: an optimizer change, judged on the one phase it changes
    phase_ms: Optional[tuple[float, float]] = None  # the update's medians, before and after (phase UPDATE)
    floor_ms: Optional[float] = None  # the step without any all-reduce, in the same rounds (where measured)
    because: Optional["Comparison"] = None  # the verdict's: the optimizer change's own comparison, where it decides

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def compare(before: Trial, after: Trial, confidence: float) -> Comparison:
    """The noise model on two trials: ``faster``/``slower`` only when the interval of the difference of their
    medians, at ``confidence``, lies wholly beyond ``MIN_GAIN`` of ``before``'s step on one side. The
    difference is the step's; for a change of the optimizer alone (both with update samples), the update's, unless
    the step itself is slower beyond the noise (then: slower)."""
    step = noise.difference_interval(before.samples_ms, after.samples_ms, confidence=confidence)
    word = _word(step, MIN_GAIN * before.median)
    if not _optimizer_only(before, after) or word == "slower":
        return Comparison(before.median, after.median, _speedup(before.median, step), word, step)
    update = noise.difference_interval(before.update_ms, after.update_ms, confidence=confidence)
    medians = (statistics.median(before.update_ms), statistics.median(after.update_ms))
    return Comparison(before.median, after.median, _speedup(before.median, update),
                      _word(update, MIN_GAIN * before.median), update, phases.UPDATE, medians)  # fmt: skip


def _word(difference: noise.Interval, gain_ms: float) -> str:
    """Faster (slower) only when the whole interval is more than ``gain_ms`` faster (slower): a change that may
    save less than ``MIN_GAIN`` is not called a speedup, however sure it is to save something. (A real gain at
    about ``MIN_GAIN`` would otherwise be faster in one tune and level in the next.)"""
    if noise.call(difference, null=-gain_ms) == "faster":
        return "faster"
    return "slower" if noise.call(difference, null=gain_ms) == "slower" else "same"


def _optimizer_only(before: Trial, after: Trial) -> bool:
    same_ddp = dataclasses.replace(after.knobs, optimizer=before.knobs.optimizer) == before.knobs
    return same_ddp and after.knobs != before.knobs and bool(before.update_ms) and bool(after.update_ms)


def _speedup(before_ms: float, difference: noise.Interval) -> noise.Interval:
    """``before / (before + difference)``: the step's speedup the difference's interval allows (can't tell where
    the interval reaches a step of no time), so that the figure and the word rest on the same interval."""

    def ratio(d: float) -> float:
        return before_ms / (before_ms + d) if before_ms + d > 0 else math.inf

    estimate = ratio(difference.estimate)
    if math.isinf(difference.low) or math.isinf(difference.high) or math.isnan(estimate):
        return noise.Interval(estimate, -math.inf, math.inf)
    return noise.Interval(estimate, ratio(difference.high), ratio(difference.low))


class Rounds:
    """Measures configurations in interleaved rounds (one round of each in turn, so that the machine's drift falls
    on every one alike), keeps every configuration's rounds together for the table, and counts the seconds."""

    def __init__(self, measure: Callable[[Knobs], Trial], budget_s: float = math.inf) -> None:
        self.measure, self.budget_s = measure, budget_s  # measure: one round of knobs
        self.rows: dict[Knobs, Trial] = {}  # every round of each configuration, in the order first measured
        self.spent, self.measured = 0.0, 0
        self.extra = 0  # rounds the caller added where a call was close

    def fresh(self, knobs: Sequence[Knobs], rounds: int) -> list[Trial]:
        """New trials of ``knobs`` (one each, repeats measured once), ``rounds`` interleaved rounds."""
        trials = [Trial(k) for k in dict.fromkeys(knobs)]
        for _ in range(rounds):
            self.more(trials)
        return trials

    def more(self, trials: Sequence[Trial]) -> None:
        """One more round of each of ``trials``, in turn."""
        for trial in trials:
            one = self.measure(trial.knobs)
            trial.absorb(one)
            self.rows.setdefault(trial.knobs, Trial(trial.knobs)).absorb(one)
            self.spent += one.seconds
            self.measured += 1

    def fit(self, configurations: int, rounds: int) -> bool:
        """``rounds`` rounds of ``configurations`` still fit in the budget, a round taking as long as the rounds so
        far did on average."""
        mean = self.spent / self.measured if self.measured else 0.0
        return self.spent + configurations * rounds * mean <= self.budget_s
