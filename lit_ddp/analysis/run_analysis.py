"""A run's one analysis: its records in, a typed ``RunAnalysis`` out, computed once and read by every renderer
(the end-of-fit tables, ``python -m lit_ddp.report``, the loggers' rows, the plots, the forecast).

    python -m lit_ddp.report runs/mini_train_profile/version_0     # load, analyze, render

Pure: no process group, no file, no text. The figures' definitions: docs/output.md, docs/stragglers.md,
docs/forecast.md.
"""

import statistics
from dataclasses import dataclass, field
from typing import Optional

from lit_ddp.derive import stragglers
from lit_ddp.derive.memory import StepMemoryFigures, memory_of
from lit_ddp.derive.stragglers import Arrivals, Straggler
from lit_ddp.derive.summaries import phase_summary, step_parts
from lit_ddp.errors import ForecastError
from lit_ddp.records.schema import CommRecord, PhaseRecord
from lit_ddp.scaling.advice import wire_savings
from lit_ddp.scaling.model import Measured, measured


@dataclass(frozen=True)
class RunAnalysis:
    """What a run's records say, once.

    ``parts``: rank 0's steady steps as the parts the verdict weighs (``lit_ddp.derive.summaries.step_parts``);
    ``step_ms``: rank 0's steady median step; ``straggler``: the straggler verdict of a run of several ranks
    (None with one rank or no common steady step); ``measured``: the forecast's inputs, or None and why
    (``not_forecast``); ``savings``: the forecast's saving per step for each change that cuts the bytes on the wire;
    ``memory``: the per-step memory of the rank whose step peaks highest (None where the run kept none).
    """

    phases: Optional[PhaseRecord]
    comm: Optional[CommRecord]
    arrivals: Optional[Arrivals] = None
    straggler: Optional[Straggler] = None
    parts: dict[str, list[float]] = field(default_factory=dict)
    step_ms: float = 0.0
    measured: Optional[Measured] = None
    not_forecast: Optional[str] = None
    savings: dict[str, float] = field(default_factory=dict)
    memory: Optional[StepMemoryFigures] = None

    @property
    def named_straggler(self) -> Optional[Straggler]:
        """The straggler when one rank is named, else None."""
        return self.straggler if self.straggler is not None and self.straggler.rank is not None else None


def analyze(phases: Optional[PhaseRecord], comm: Optional[CommRecord]) -> RunAnalysis:
    """The run's analysis from its records (either may be None): the arrivals and the straggler once, the step's
    parts, the forecast's inputs and the savings they give, the memory per step."""
    found = stragglers.arrivals(comm) if comm is not None else None
    straggler = stragglers.straggler_of(found, comm, phases) if comm is not None else None
    parts: dict[str, list[float]] = {}
    step_ms = 0.0
    if phases is not None:
        parts = step_parts(phases, comm, found)
        step_ms = phase_summary(phases, 0, "step").median
    try:
        inputs, why = measured(phases, comm), None
    except ForecastError as err:
        inputs, why = None, str(err)
    savings = wire_savings(comm, inputs, found)
    return RunAnalysis(phases, comm, found, straggler, parts, step_ms, inputs, why, savings, memory_of(phases))


def median_parts(analysis: RunAnalysis) -> dict[str, float]:
    """Each part's median over rank 0's steady steps."""
    return {p: statistics.median(v) for p, v in analysis.parts.items() if v}
