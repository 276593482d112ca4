"""A record's figures over the steady steps, per rank: a phase's or a bucket's ``Sketch``, the micro-batches per
step, and rank 0's step as the parts the verdict weighs. Pure: records in, figures out.

    python -m lit_ddp.report runs/mini_train_profile/version_0     # the tables print these

What a steady step is: docs/architecture.md#steps.
"""

from collections.abc import Callable, Sequence
from typing import Optional

from lit_ddp.derive.stragglers import Arrivals
from lit_ddp.records import phases as phase_table
from lit_ddp.records.schema import CommRecord, PhaseRecord, Sketch


def sketch_or(summaries: dict[str, Sketch], name: str, fallback: Callable[[], Sequence[float]]) -> Sketch:
    """The record's summary of ``name`` over the steady steps; a run too short to have one (a 1-step run)
    falls back to the steps it kept."""
    found = summaries.get(name)
    return found if found is not None and found.count else Sketch.of(fallback())


def phase_summary(record: PhaseRecord, rank: int, phase: str) -> Sketch:
    """``phase`` on ``rank`` over the steady steps."""
    rows = record.steady_rows(rank) or record.ranks[rank].rows
    return sketch_or(record.ranks[rank].summaries, phase, lambda: [getattr(r.ms, phase) for r in rows])


def comm_summary(record: CommRecord, rank: int, name: str) -> Sketch:
    """``name`` (``bucket<i>.ms``, ``bucket<i>.ready_ms``, ``busy_ms``, ``exposed_ms``, ``total_ms``) on ``rank``
    over the steady steps with the final layout."""
    rows = [r for r in record.ranks[rank].rows if r.bytes == record.layout]

    def kept() -> list[float]:
        if name == "total_ms":
            return [sum(r.ms) for r in rows]
        if name.startswith("bucket"):
            b, _, field_name = name[len("bucket") :].partition(".")  # rpartition alike: "bucket0.ms", one dot
            return [getattr(r, field_name)[int(b)] for r in rows]
        return [getattr(r, name) for r in rows]

    return sketch_or(record.ranks[rank].summaries, name, kept)


def micro_batches(record: PhaseRecord) -> int:
    """Batches per optimizer step (gradient accumulation), as rank 0's steady steps ran them (most of them)."""
    counts = [r.micro_batches for r in record.steady_rows(0) or record.ranks[0].rows]
    return max(set(counts), key=counts.count) if counts else 1


def step_parts(record: PhaseRecord, comm: Optional[CommRecord], found: Optional[Arrivals]) -> dict[str, list[float]]:
    """Rank 0's steady steps as the parts of its step, one sample per step in step order: the phases, with
    backward split where CommMonitor's record has the step (its compute, the exposed transfer, the wait for the
    last rank's arrival at the all-reduce, from the run's ``found`` arrivals)."""
    rows = record.steady_rows(0) or record.ranks[0].rows
    names, split = phase_table.names(), phase_table.ALL_REDUCING
    if comm is None or record.meta.world_size < 2:
        return {p: [getattr(r.ms, p) for r in rows] for p in names}
    buckets = {r.step: r for r in comm.ranks[0].rows if r.bytes == comm.layout}
    waits = dict(zip(found.steps, found.waits[0], strict=True)) if found else {}
    rows = [r for r in rows if r.step in buckets]
    parts = {p: [getattr(r.ms, p) for r in rows] for p in names if p != split}
    exposed = [buckets[r.step].exposed_ms for r in rows]
    wait = [min(waits.get(r.step, 0.0), e) for r, e in zip(rows, exposed, strict=True)]
    parts[split] = [r.ms[split] - e for r, e in zip(rows, exposed, strict=True)]
    parts["exposed"] = [e - w for e, w in zip(exposed, wait, strict=True)]
    parts["wait"] = wait
    return parts
