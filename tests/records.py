"""Hand-made run records (``lit_ddp.records.schema``) for the tests of their readers: per-step figures in, a
``PhaseRecord`` or ``CommRecord`` out, its summaries made by the record's own rules (``is_steady``, the final
bucket layout) as PhaseTimer and CommMonitor make them."""

from collections.abc import Iterable, Sequence
from typing import Optional

from lit_ddp.records import phases
from lit_ddp.records.schema import (
    CommRecord,
    PhaseRecord,
    RankComm,
    RankPhases,
    Roofline,
    RunMeta,
    Sketch,
    StepBuckets,
    StepPhases,
    StepRow,
)
from lit_ddp.records.steps import is_steady


def meta(world_size: int = 1, clock: str = "perf_counter") -> RunMeta:
    return RunMeta(world_size=world_size, device="cpu", device_name="cpu", backend="gloo", clock=clock,
                   precision="32-true", torch="test", lightning="test")  # fmt: skip


def step_row(step: int, forward: float, backward: float, update: float, other: float) -> StepRow:
    """One step whose phases follow each other from its start, ``other`` after them; ``step`` is their sum."""
    total = forward + backward + update + other
    ends = [0.0, forward, forward, forward + backward, forward + backward, forward + backward + update, total]
    marks = dict(zip(phases.boundaries(), ends, strict=False))
    return StepRow(step, StepPhases(forward=forward, backward=backward, update=update, other=other, step=total), marks)


def phase_record(
    per_rank: Sequence[Sequence[Sequence[float]]],
    profiled: Iterable[int] = (),
    clock: str = "perf_counter",
    roofline: Optional[Roofline] = None,
    busy: Sequence[Sequence[float]] = (),
) -> PhaseRecord:
    """``per_rank[r][i]``: (forward, backward, update, other) of step ``i`` on rank ``r``, every step kept;
    ``busy``: rank 0's GPU-busy (forward, backward, update, other) of each profiled step."""
    profiled = list(profiled)
    ranks = []
    for r, steps in enumerate(per_rank):
        rows = [step_row(i, *phases) for i, phases in enumerate(steps)]
        steady = [row.ms for row in rows if is_steady(row.step, profiled)]
        summaries = {p: Sketch.of(ms[p] for ms in steady) for p in phases.with_step()}
        busy_rows = [step_row(s, *phases) for s, phases in zip(profiled, busy, strict=False)] if r == 0 else []
        for row in busy_rows:
            row.offsets_ms = {}  # PhaseTimer records no boundaries for the busy rows
        ranks.append(RankPhases(r, rows, summaries, busy_rows))
    return PhaseRecord(meta(len(per_rank), clock), ranks, profiled, roofline)


def comm_summaries(rows: Sequence[StepBuckets], layout: Sequence[int], profiled: Iterable[int]) -> dict[str, Sketch]:
    """What CommMonitor summarises: the steady steps with the final ``layout``."""
    profiled = list(profiled)
    kept = [r for r in rows if is_steady(r.step, profiled) and r.bytes == list(layout)]
    figures: dict[str, list[float]] = {"busy_ms": [r.busy_ms for r in kept], "exposed_ms": [r.exposed_ms for r in kept],
                                       "total_ms": [sum(r.ms) for r in kept]}  # fmt: skip
    for b in range(len(layout)):
        figures[f"bucket{b}.ms"] = [r.ms[b] for r in kept]
        figures[f"bucket{b}.ready_ms"] = [r.ready_ms[b] for r in kept]
    return {name: Sketch.of(values) for name, values in figures.items()}


def comm_record(
    per_rank: Sequence[Sequence[StepBuckets]],
    param_bytes: int,
    profiled: Iterable[int] = (),
    compression: Optional[str] = None,
) -> CommRecord:
    """``per_rank[r]``: rank ``r``'s buckets per step, every step kept; the layout is that of the last step."""
    profiled = list(profiled)
    layout = list(per_rank[0][-1].bytes)
    ranks = [RankComm(r, list(rows), comm_summaries(rows, layout, profiled)) for r, rows in enumerate(per_rank)]
    return CommRecord(meta(len(per_rank)), ranks, layout, param_bytes, compression, list(per_rank[0][0].bytes),
                      profiled)  # fmt: skip
