"""A run's memory per step and phase as the phase table shows it: the rank whose step peaks highest, and its medians
of each phase's peak and retained bytes. Pure: the record in, figures out (``lit_ddp.present.memory`` writes them).

    python -m lit_ddp.report runs/mini_train_profile/version_0     # the phase table's memory columns

How each figure is measured and what it means: docs/memory.md.
"""

from dataclasses import dataclass
from typing import Optional

from lit_ddp.records import phases as phase_table
from lit_ddp.records.schema import PhaseRecord, Sketch, StepMemory


@dataclass(frozen=True)
class StepMemoryFigures:
    """The memory of the rank whose step peaks highest (median): ``peak`` and ``retained`` per phase (the table's
    order, then the step; an empty ``Sketch`` where it has no figure), ``start``: what the steps started from,
    ``steps``: the kept steps with memory figures, ``source``: whose bytes they are (``PhaseRecord.memory_source``)."""

    rank: int
    source: Optional[str]
    peak: dict[str, Sketch]
    retained: dict[str, Sketch]
    start: Sketch
    steps: list[int]


def memory_of(record: Optional[PhaseRecord]) -> Optional[StepMemoryFigures]:
    """The record's memory figures; None for a run that kept none."""
    if record is None or not any(r.memory for r in record.ranks):
        return None
    rank = max(range(len(record.ranks)), key=lambda r: memory_summary(record, r, "peak.step").median)

    def per_phase(kind: str) -> dict[str, Sketch]:
        return {p: memory_summary(record, rank, f"{kind}.{p}") for p in phase_table.with_step()}

    steps = [m.step for m in record.ranks[rank].memory]
    start = memory_summary(record, rank, "start")
    return StepMemoryFigures(rank, record.memory_source, per_phase("peak"), per_phase("retained"), start, steps)


def memory_summary(record: PhaseRecord, rank: int, name: str) -> Sketch:
    """``name`` (``start``, ``peak.<phase>``, ``retained.<phase>``) on ``rank``: its summary, else over the steps
    it kept."""
    found = record.ranks[rank].memory_summaries.get(name)
    if found is not None and found.count:
        return found
    return Sketch.of(_figure(m, name) for m in record.ranks[rank].memory if _figure(m, name) is not None)


def _figure(row: StepMemory, name: str) -> Optional[int]:
    if name == "start":
        return row.start
    kind, _, phase = name.partition(".")  # rpartition alike: "peak.backward" has one dot
    return (row.peak if kind == "peak" else row.retained).get(phase)
