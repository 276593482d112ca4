"""What each row of a comparison is made of (``lit_ddp.present.compare``): a run's samples per steady step and
row, how far apart the run's ranks were in each row, and a profile's samples per counted step.

    python -m lit_ddp.report RUN_A --compare RUN_B     # the rows: docs/noise.md, "Comparing two runs"
"""

import statistics
from collections.abc import Sequence
from typing import Optional

from lit_ddp.derive import noise, stragglers
from lit_ddp.derive.trace import RankAnalysis
from lit_ddp.records import phases as phase_table
from lit_ddp.records.schema import CommRecord, PhaseRecord, RankPhases, StepMemory
from lit_ddp.records.steps import is_steady


def _per_step(record: PhaseRecord, value) -> dict[int, float]:
    """Per steady step every rank kept: the mean over ranks of ``value(row)``."""
    left_out = {*record.profiled_steps, *record.skipped_steps}
    per_rank = [{r.step: value(r) for r in rank.rows if is_steady(r.step, left_out)} for rank in record.ranks]
    steps = sorted(set.intersection(*(set(d) for d in per_rank)))
    return {s: statistics.fmean(d[s] for d in per_rank) for s in steps}


def _steady_memory(record: PhaseRecord, rank: RankPhases) -> list[StepMemory]:
    """The rank's memory figures of the steps the phases are compared on (no warm-up, profiled or skipped step)."""
    left_out = {*record.profiled_steps, *record.skipped_steps}
    return [m for m in rank.memory if m.peak.get("step") is not None and is_steady(m.step, left_out)]


def run_samples(phases: Optional[PhaseRecord], comm: Optional[CommRecord]) -> dict[str, tuple[str, list[float]]]:
    """``{row: (unit, per-step samples)}`` of one run: each phase (mean over ranks), the exposed communication
    (mean over ranks), each bucket's transfer (the shortest across ranks) and wait (last arrival minus first),
    and the peak memory of the step (the highest rank); the steady steps only (``is_steady``)."""
    out: dict[str, tuple[str, list[float]]] = {}
    if phases is not None:
        # The step first (the rows' order).
        for p in (phase_table.STEP, *phase_table.names()):
            out[p] = ("ms", list(_per_step(phases, lambda r, p=p: getattr(r.ms, p)).values()))
    if comm is not None:
        kept = [{r.step: r for r in rank.rows if r.bytes == comm.layout and is_steady(r.step, comm.profiled_steps)}
                for rank in comm.ranks]  # fmt: skip
        steps = sorted(set.intersection(*(set(k) for k in kept)))
        out["exposed comm"] = ("ms", [statistics.fmean(k[s].exposed_ms for k in kept) for s in steps])
        found = stragglers.arrivals(comm)
        for b in range(len(comm.layout)):
            if found is not None:
                out[f"bucket {b} transfer"] = ("ms", found.transfer_per_bucket[b])
                out[f"bucket {b} wait"] = ("ms", found.wait_per_bucket[b])
            else:
                out[f"bucket {b} all-reduce"] = ("ms", [kept[0][s].ms[b] for s in steps])
    if phases is not None:
        per_rank = [{m.step: m.peak["step"] for m in _steady_memory(phases, rank)} for rank in phases.ranks]
        # A record without ranks fails in _per_step above.
        steps = sorted(set.intersection(*(set(d) for d in per_rank))) if per_rank else []
        if steps:
            out["peak memory"] = ("B", [float(max(d[s] for d in per_rank)) for s in steps])
    return out


def _range_of_medians(per_rank: Sequence[Sequence[float]]) -> float:
    return noise.process_spread([statistics.median(x) for x in per_rank if x])


def run_spreads(phases: Optional[PhaseRecord], comm: Optional[CommRecord]) -> dict[str, float]:
    """``{row: how far apart the run's ranks' medians were}``: what two processes of one job differ by here, the
    allowance one run per side gets for another run's processes (``noise.process_spread``). The step's is the sum
    of its parts' (a step is their sum, and each part may move by its own); a bucket's wait takes the ranks' waits
    for the last rank's hand-over."""
    out: dict[str, float] = {}
    if phases is not None:
        left_out = {*phases.profiled_steps, *phases.skipped_steps}
        for p in phase_table.with_step():
            out[p] = _range_of_medians([[getattr(r.ms, p) for r in rank.rows if is_steady(r.step, left_out)]
                                        for rank in phases.ranks])  # fmt: skip
        out["step"] = max(out["step"], sum(v for p, v in out.items() if p != "step"))
        out["peak memory"] = _range_of_medians([[float(m.peak["step"]) for m in _steady_memory(phases, rank)]
                                                for rank in phases.ranks])  # fmt: skip
    if comm is not None:
        rows = [[r for r in rank.rows if r.bytes == comm.layout and is_steady(r.step, comm.profiled_steps)]
                for rank in comm.ranks]  # fmt: skip
        out["exposed comm"] = _range_of_medians([[r.exposed_ms for r in k] for k in rows])
        found = stragglers.arrivals(comm)
        for b in range(len(comm.layout)):
            own = _range_of_medians([[r.ms[b] for r in k] for k in rows])
            out[f"bucket {b} transfer"] = out[f"bucket {b} all-reduce"] = own
            out[f"bucket {b} wait"] = _range_of_medians(found.waits) if found is not None else 0.0
    return out


def trace_samples(analyses: Sequence[RankAnalysis]) -> dict[str, tuple[str, list[float]]]:
    """``{row: (unit, per-step samples)}`` of one job's traces: per counted step, the mean over ranks of the
    step's span, each phase's span, the GPUs' compute, communication, idle time and the exposed communication."""
    figures: dict[str, dict[int, list[float]]] = {}

    def add(name: str, step: int, us: Optional[float]) -> None:
        if us is not None:
            figures.setdefault(name, {}).setdefault(step, []).append(us / 1e3)

    for a in analyses:
        for s in a.steps:
            if not s.counted:
                continue
            b = s.breakdown
            add("step (span)", s.step, b.span_us)
            for p in phase_table.names():
                if p in s.phases:
                    add(f"{p} (span)", s.step, s.phases[p].span_us)
            add("compute", s.step, b.compute_us)
            add("communication", s.step, b.communication_us)
            add("exposed comm", s.step, s.exposed_comm_us)
            add("idle", s.step, b.idle_us)
    n = len(analyses)
    return {name: ("ms", [statistics.fmean(v) for _, v in sorted(per_step.items()) if len(v) == n])
            for name, per_step in figures.items()}  # fmt: skip
