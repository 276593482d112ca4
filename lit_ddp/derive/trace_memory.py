"""Memory per step and phase from a ``profile_memory=True`` trace: the allocator's ``[memory]`` events of one rank,
read through ``lit_ddp.derive.trace``.

    step_memory(load("rank0.pt.trace.json.gz"))    # a StepMemoryTrace per lit_ddp.step#N

How the figures are anchored and what the profiler cannot see: docs/memory.md.
"""

from bisect import bisect_right
from dataclasses import dataclass

from lit_ddp.derive.trace import CPU_DEVICE, Trace
from lit_ddp.records import phases
from lit_ddp.records.ranges import STEP_PREFIX


@dataclass(frozen=True)
class StepMemoryTrace:
    """One step's memory from a trace: per phase (``lit_ddp.records.phases``, and ``step`` the whole step), the most
    held at once and what was held at its last range's end, in bytes above what the step started with."""

    step: int
    peak: dict[str, int]
    retained: dict[str, int]


def step_memory(trace: Trace, device_type: int = CPU_DEVICE) -> list[StepMemoryTrace]:
    """The memory of each ``lit_ddp.step#N`` in ``trace`` from its ``[memory]`` events of ``device_type``, phase by
    phase (the tool's own phase ranges; an event in none counts for the step only); empty without memory
    events."""
    events = [m for m in trace.memory if m.device_type == device_type]
    if not events:
        return []
    times = [m.ts_us for m in events]
    # Bytes allocated since the trace began, after each event; any start alike: every figure is a level less the base.
    levels = [0]
    for m in events:
        levels.append(levels[-1] + m.bytes)

    def level_at(t: float) -> int:
        return levels[bisect_right(times, t)]

    def peak_in(a: float, b: float) -> int:
        return max(levels[bisect_right(times, a) : bisect_right(times, b) + 1])

    found = []
    for step in sorted((r for r in trace.ranges if r.name.startswith(STEP_PREFIX)), key=lambda r: r.start_us):
        base = level_at(step.start_us)
        own = phases.ranges()
        inside = [r for r in trace.ranges if r.name in own and step.start_us <= r.start_us < step.end_us]
        peak, retained = {"step": peak_in(step.start_us, step.end_us) - base}, {"step": level_at(step.end_us) - base}
        # key= alike: a phase's figures come from its own ranges alone, which sorted as tuples (name first) are in
        # start order too (only the dicts' key order moves, and they are read by key).
        for r in sorted(inside, key=lambda r: r.start_us):
            phase = own[r.name]
            peak[phase] = max(peak.get(phase, 0), peak_in(r.start_us, r.end_us) - base)
            retained[phase] = level_at(r.end_us) - base
        found.append(StepMemoryTrace(int(step.name.removeprefix(STEP_PREFIX)), peak, retained))
    return found
