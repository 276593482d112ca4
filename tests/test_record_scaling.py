"""A rank's record does not grow with the run: a 100,000-step run keeps what a 10,000-step one does, plus at most
the summaries' growth (their sketches add a bin per new magnitude, not per step)."""

import json
import random

from lit_ddp.records import phases as phase_table
from lit_ddp.records.phases import StepPhases
from lit_ddp.records.schema import RankPhases, Sketch, StepRow, as_json
from lit_ddp.records.steps import Window, is_steady


def collect(steps: int, seed: int = 0) -> RankPhases:
    """What PhaseTimer keeps on one rank for ``steps`` steps of lognormal phase times."""
    rng = random.Random(seed)
    window, summaries = Window(profiled=range(2, 5)), {phase: Sketch() for phase in phase_table.with_step()}
    for step in range(steps):
        parts = [rng.lognormvariate(0, 0.3) for _ in range(4)]
        phases = StepPhases(zip(("forward", "backward", "update", "other"), parts, strict=True), step=sum(parts))
        window.add(step, StepRow(step, phases, dict.fromkeys(phase_table.boundaries()[:7], 0.0)))
        if is_steady(step, window.profiled):
            for name in phase_table.with_step():
                summaries[name].add(phases[name])
    return RankPhases(0, [row for _, row in window.items()], summaries)


def size(value) -> int:
    return len(json.dumps(as_json(value)))


def test_a_longer_run_keeps_the_same_steps_and_summaries_of_bounded_size():
    short, long = collect(10_000), collect(100_000)
    assert len(long.rows) == len(short.rows)  # head, profiled, tail: the same number of kept steps
    growth = size(long) - size(short)
    assert growth <= size(long.summaries), (growth, size(long.summaries))
    assert size(long.summaries) < 20_000  # a few hundred bins per phase at most, whatever the count
    assert long.summaries["step"].count == 100_000 - 4  # every steady step is counted
