"""What bounds a CPU run's step, decided once for the verdict line and the headline that opens the end-of-fit block:
the two largest parts of rank 0's steady step and whether the first leads the second beyond the noise.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2     # the headline, then the tables

The rule (a lead beyond the noise, by ``LEAD_SHARE`` of the step at least): docs/noise.md, "Where it decides".
"""

import statistics
from dataclasses import dataclass
from typing import Optional

from lit_ddp.analysis.run_analysis import RunAnalysis
from lit_ddp.derive import noise
from lit_ddp.derive.summaries import phase_summary
from lit_ddp.formatting import fmt_ms
from lit_ddp.records import phases as step_phases

# A part bounds the step when it leads the next by this share of the step at least, beyond the noise (the lead's
# interval above it): a lead of a few percent bounds nothing (a 1024-wide linear on 2 CPU ranks: the all-reduce
# led forward by 4% of the step in one of five runs, and by 11% (4% to 17%) in one of five on a quiet machine).
LEAD_SHARE = 0.1
# The parts of a step the verdict weighs (step_parts): the phases, by their names (lit_ddp.records.phases), and the
# two that CommMonitor's record splits out of the all-reducing one (backward).
SPLIT_NAMES = {"exposed": "the all-reduce's exposed transfer", "wait": "the wait for a later rank"}


@dataclass(frozen=True)
class Bound:
    """Rank 0's two largest parts (``first``, ``second``), each part's median and share of the step, the first's
    per-step lead over the second (``gap``, over ``n`` steps), and whether it bounds the step (``called``)."""

    first: str
    second: str
    medians: dict[str, float]
    share: dict[str, float]
    gap: noise.Interval
    n: int
    called: bool
    backward_ms: float  # rank 0's steady median backward phase, the all-reduce in it included

    def name(self, part: str) -> str:
        """The part as the figures call it: backward split by CommMonitor is backward's compute, of its whole."""
        if part == step_phases.ALL_REDUCING and "exposed" in self.medians:
            return f"backward's compute ({fmt_ms(self.medians[part])} of its {fmt_ms(self.backward_ms)})"
        return f"{SPLIT_NAMES.get(part, part)} ({fmt_ms(self.medians[part])})"

    @property
    def lead(self) -> str:
        """The first part's lead, said as what it is: ``47.30 ms more per step (...) than backward's compute (...)``."""
        g = self.gap
        return (f"{fmt_ms(g.estimate)} more per step ({fmt_ms(g.low)} to {fmt_ms(g.high)}, 95%, {self.n} steps) than "
                f"{self.name(self.second)}")  # fmt: skip


def cpu_bound(analysis: RunAnalysis) -> Optional[Bound]:
    """The step's bound from rank 0's parts; None with fewer than ``noise.MIN_SAMPLES`` steady steps."""
    parts, step_ms = analysis.parts, analysis.step_ms
    n = len(next(iter(parts.values())))
    if n < noise.MIN_SAMPLES:
        return None
    medians = {p: statistics.median(v) for p, v in parts.items()}
    first, second = sorted(parts, key=medians.get, reverse=True)[:2]
    gap = noise.median_interval([a - b for a, b in zip(parts[first], parts[second], strict=True)])
    share = {p: medians[p] / step_ms if step_ms else 0.0 for p in parts}
    called = noise.call(gap, null=LEAD_SHARE * step_ms) == "slower"  # the lead beyond the noise above the floor
    backward = phase_summary(analysis.phases, 0, step_phases.ALL_REDUCING).median
    return Bound(first, second, medians, share, gap, n, called, backward)


def steady_count(analysis: RunAnalysis) -> int:
    return len(next(iter(analysis.parts.values())))
