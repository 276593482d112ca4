"""The GPU check's GPU-busy section: PhaseTimer's GPU-busy time against torch.profiler's own kernel figures.

    python benchmarks/gpu_check.py out.txt --sections busy

The profile's events are read in one place, ``profile_activity`` (the Chrome trace PhaseTimer kept, as plain JSON,
sorted by ``gpu_activity``): it finds PhaseTimer's steps through their GPU user annotations (each
``lit_ddp.step#N`` range drawn on the GPU timeline), which ``lit_ddp.derive.trace`` leaves out of a trace's ops. The
second fit's profile is read both ways: torch.profiler's own total, and ``lit_ddp.derive.trace`` over its exported
Chrome trace (``trace_busy_ms``).
"""

import math
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple, Optional

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from typing_extensions import override

from benchmarks.common import fmt_num, fmt_pct, ratio
from benchmarks.gpu_fits import DIM, KERNEL_STEPS, LIMIT, Budget, Section, StepWindow, fit, profiled_fit, quiet_loss
from lit_ddp.callbacks import CommMonitor, PhaseTimer
from lit_ddp.callbacks.phase_timer import FIRST_PROFILED_STEP
from lit_ddp.derive import trace
from lit_ddp.formatting import table
from lit_ddp.maths.intervals import union_length
from lit_ddp.records.schema import PhaseRecord


class GpuActivity(NamedTuple):
    """The GPU side of a torch.profiler trace, on the profiler's clock, in ms."""

    kernels: list[tuple[float, float]]  # kernels, memcpy, memset: the GPU's work
    steps: list[tuple[str, float, float]]  # PhaseTimer's step ranges on the GPU timeline, ("lit_ddp.step#2", ...)
    annotations: list[tuple[str, float, float]]  # the other GPU user annotations (record_function ranges)


GPU_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}


def gpu_activity(events: Iterable[dict[str, Any]]) -> GpuActivity:
    """Sorts a Chrome trace's events into kernels, PhaseTimer's steps and GPU user annotations.

    A step is found through its GPU user annotation: kineto draws each ``lit_ddp.step#N`` record_function on the
    GPU timeline from the first to the last GPU op launched inside it. This uses neither the correlation ids nor
    the launch times that ``lit_ddp.derive.trace`` (so PhaseTimer) uses, so that the two can be held against each
    other.
    """
    spans = [(e, e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events if e.get("ph") == "X" and "dur" in e]
    annotations = [(e["name"], s, t) for e, s, t in spans if e.get("cat") == "gpu_user_annotation"]
    steps = sorted((a for a in annotations if a[0].startswith(trace.STEP_PREFIX)),
                   key=lambda a: int(a[0].removeprefix(trace.STEP_PREFIX)))  # fmt: skip
    work = [(s, t) for e, s, t in spans if e.get("cat") in GPU_WORK]
    others = [a for a in annotations if not a[0].startswith(trace.STEP_PREFIX)]
    return GpuActivity(work, steps, others)


def profile_activity(kept: Optional[dict[str, Any]]) -> GpuActivity:
    """The GPU side of the trace PhaseTimer kept (nothing for none): the one place this section reads kernels."""
    return gpu_activity(kept["traceEvents"]) if kept is not None else GpuActivity([], [], [])


def device_total_ms(prof: profile) -> float:
    """torch.profiler's own total GPU time, the "Self CUDA time total" of ``key_averages().table()``: the device
    rows' ``self_device_time_total`` summed, GPU user annotations left out (us -> ms)."""
    device_rows = [r for r in prof.key_averages() if r.device_type == DeviceType.CUDA]
    return sum(r.self_device_time_total for r in device_rows if not getattr(r, "is_user_annotation", False)) / 1e3


def trace_busy_ms(prof: profile) -> float:
    """GPU-busy ms of a whole profile as ``lit_ddp.derive.trace`` reads its exported Chrome trace: the union of every
    kernel, memcpy and memset, without torch in the reading."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "rank0.pt.trace.json")  # the rank in the name, for a trace without distributedInfo
        prof.export_chrome_trace(str(path))
        return file_busy_ms(path)


def file_busy_ms(path: Path) -> float:
    """``lit_ddp.derive.trace``'s busy time of the trace file at ``path``, in ms; NaN for a trace without GPU ops."""
    found = trace.breakdown(trace.load(path).ops)
    return found.busy_us / 1e3 if found is not None else math.nan


def sum_ms(intervals: Iterable[tuple[float, float]], start: float = -math.inf, end: float = math.inf) -> float:
    """Sum of the intervals' lengths inside ``[start, end]``: overlapping time counts twice, unlike ``union_length``."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in intervals)


def timer_busy(record: PhaseRecord) -> tuple[float, int]:
    """PhaseTimer's GPU-busy "step" time summed over the steps it profiled (rank 0), and how many there were."""
    rows = record.ranks[0].busy_ms
    return sum(row.ms.step for row in rows), len(rows)


class StepProfiler(StepWindow):
    """``torch.profiler`` (CPU + CUDA, as PhaseTimer's TraceRecorder) over its window of steps.

    Args:
        first: The first profiled step.
        steps: How many steps to profile.
    """

    def __init__(self, first: int, steps: int) -> None:
        super().__init__(first, steps)
        self.profile: Optional[profile] = None

    @override
    def begin(self) -> None:
        self.profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.profile.__enter__()

    @override
    def end(self) -> None:
        self.profile.__exit__(None, None, None)  # synchronizes: every kernel launched so far is in


def independent_profile_ms() -> tuple[float, float]:
    """Our own profiler over steps 2-4 of a fit like ``profiled_fit``'s, but with PhaseTimer not profiling (so none
    of its ranges): its device total (ms), and its busy time as ``lit_ddp.derive.trace`` reads it (NaN without
    one)."""
    profiler = StepProfiler(FIRST_PROFILED_STEP, KERNEL_STEPS)
    callbacks = [profiler, PhaseTimer(print_steps=0, kernel_steps=0), CommMonitor(), quiet_loss()]
    with tempfile.TemporaryDirectory() as tmp:
        fit(callbacks, FIRST_PROFILED_STEP + KERNEL_STEPS + 1, Path(tmp))
    if profiler.profile is None:
        return math.nan, math.nan
    return device_total_ms(profiler.profile), trace_busy_ms(profiler.profile)


def busy_rows(timer_ms: float, steps: int, measures: list[tuple[str, float]]) -> list[tuple]:
    first = (f"PhaseTimer busy 'step' column, summed over its {steps} profiled steps", fmt_num(timer_ms), "")
    return [first, *((name, fmt_num(value), fmt_num(ratio(timer_ms, value))) for name, value in measures)]


def busy_section(budget: Budget) -> Section:
    """PhaseTimer's GPU-busy time against torch.profiler's own kernel figures, over the same steps.

    What is comparable: PhaseTimer's busy "step" column is the union of the GPU ops each profiled step (2-4) queued,
    read by ``lit_ddp.derive.trace`` from the trace PhaseTimer kept (ops linked to their launch by correlation id).
    The
    reference is computed from the *same* trace (PhaseTimer's own profiler, kept by ``profiled_fit``), independently
    of those links: PhaseTimer's ``lit_ddp.step#N`` ranges found as GPU user annotations (``gpu_activity``), then (a)
    the union of the kernels' intervals from the first step's start to the last one's end on the GPU timeline: the
    same quantity, so the two must agree within 5%, else PhaseTimer's bookkeeping is wrong; (b) the plain sum of
    their durations in that window, above the union only where streams overlap (NCCL next to compute; on one GPU
    nothing should); (c) ``key_averages()``'s total device time of the whole profile (what the profiler's table
    prints). GPU user annotations (record_function ranges such as ``DistributedDataParallel.forward`` or
    ``Optimizer.step#Adam.step`` drawn on the GPU timeline, gaps included) are not work: when PhaseTimer's figure
    matches the union *with* them, it counts them as busy. Two profilers cannot run at once, so the independent
    measurement is (d): a second, otherwise identical fit without PhaseTimer's profile, with our own profiler from
    the start of step 2 to the start of step 5. It differs from the first by run-to-run variation, so it is
    reported, not held to 5%.
    """
    first, last = FIRST_PROFILED_STEP, FIRST_PROFILED_STEP + KERNEL_STEPS - 1
    section = Section(f"GPU-busy time, PhaseTimer against torch.profiler (steps {first}-{last}, dim {DIM})")
    run = profiled_fit(budget.fit_steps)
    timer_ms, steps = timer_busy(run.phases)  # no steps when no profiled step was complete
    gpu = profile_activity(run.trace)
    if not steps or not gpu.steps or run.profile is None:
        section.lines.append(f"busy_ms: {steps} steps; PhaseTimer's steps on the GPU timeline: {len(gpu.steps)}")
        section.verdicts.append("busy: NOT MEASURED (no busy_ms from PhaseTimer, or no step ranges in its trace)")
        return section
    (first_label, w0, _), (last_label, _, w1) = gpu.steps[0], gpu.steps[-1]
    kernel_union = union_length(gpu.kernels, w0, w1)
    with_annotations = union_length(gpu.kernels + [(s, e) for _, s, e in gpu.annotations], w0, w1)
    second, second_busy = independent_profile_ms()
    measures = [
        ("(a) same trace: union of kernel intervals, first to last step on the GPU", kernel_union),
        ("(b) same trace: sum of kernel durations in that window", sum_ms(gpu.kernels, w0, w1)),
        ("(c) same profile: key_averages() device total", device_total_ms(run.profile)),
        ("    (a) with GPU user annotations counted as busy", with_annotations),
        ("(d) second fit, own profiler, no PhaseTimer profile: key_averages() device total", second),
        ("    (d)'s Chrome trace read by lit_ddp.derive.trace: union of its GPU ops", second_busy),
    ]
    section.lines += table(("measure", "ms", "PhaseTimer / it"), busy_rows(timer_ms, steps, measures)).splitlines()
    section.lines.append(f"window: {first_label} start to {last_label} end on the GPU timeline; "
                         f"{len(gpu.kernels)} kernels and copies in the trace")  # fmt: skip
    if gpu.annotations:
        names = Counter(n for n, _, _ in gpu.annotations).most_common(6)
        section.lines.append("GPU user annotations in the profile: " + ", ".join(f"{n} x{c}" for n, c in names))
    off = ratio(timer_ms, kernel_union) - 1
    verdict = f"busy: {'OK' if abs(off) <= LIMIT else 'MISSED'}, PhaseTimer {timer_ms:.3f} ms vs the same trace's "
    verdict += f"kernel union {kernel_union:.3f} ms ({fmt_pct(off)}, limit {LIMIT:.0%})"
    if abs(off) > LIMIT and gpu.annotations and abs(ratio(timer_ms, with_annotations) - 1) <= LIMIT:
        verdict += "; it matches the union WITH GPU user annotations: PhaseTimer counts them as kernels"
    section.verdicts.append(verdict)
    section.verdicts.append(
        f"busy: a second fit's own profiler measured {second:.3f} ms ({fmt_pct(ratio(timer_ms, second) - 1)} "
        "from PhaseTimer; run-to-run variation included)"
    )
    return section
