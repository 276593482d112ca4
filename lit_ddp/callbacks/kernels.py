"""GPU-busy time inside each phase of a step: the kernels that ran between the phase's marks, from
``torch.profiler`` (kineto), over a few steady steps. PhaseTimer's helper.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 1   # on a GPU

A CUDA event pair measures everything between its two records, idle time included: when the GPU waits for
Python between tiny kernels, "forward 0.6 ms" may hold 0.2 ms of work. To tell busy from idle, every phase
boundary of the profiled steps also launches a one-element marker kernel inside a ``record_function`` named
after the boundary; on the GPU's timeline the marker's start *is* the boundary (a stream runs in order). The
busy time of a phase is the union of all kernels' intervals (every stream, NCCL's included) clipped to the
window between its two markers.
"""

import math
from collections.abc import Iterable
from typing import NamedTuple, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

MARK_PREFIX = "lit_ddp::mark::"


class TraceEvent(NamedTuple):
    """One event of a torch.profiler trace, as kineto recorded it; times in ms from the trace's start."""

    name: str
    device_type: DeviceType
    start_ms: float
    end_ms: float
    thread: int
    correlation_id: int  # of a CPU op: its id, which the kernels it launched link to
    linked_correlation_id: int  # of a kernel (or runtime call): the correlation id of the CPU op that launched it
    is_user_annotation: bool  # a record_function range (on the GPU timeline: from its first kernel to its last)


def trace_events(prof: profile) -> list[TraceEvent]:
    """The raw kineto events of a stopped ``profile``, without torch's parsing into ``FunctionEvent``s (slow, and
    torch 2.11's ``FunctionEvent`` has no ``linked_correlation_id``)."""
    result = prof.profiler.kineto_results
    t0 = result.trace_start_ns()
    return [
        TraceEvent(e.name(), e.device_type(), (e.start_ns() - t0) / 1e6, (e.end_ns() - t0) / 1e6,
                   e.start_thread_id(), e.correlation_id(), e.linked_correlation_id(), e.is_user_annotation())
        for e in result.events()
    ]  # fmt: skip


def is_gpu_work(event: TraceEvent) -> bool:
    """Kernels, memcpy and memset; GPU user annotations (record_function ranges drawn on the GPU timeline) span
    the gaps between kernels: they are not work, and torch's own device totals leave them out too."""
    return event.device_type == DeviceType.CUDA and not event.is_user_annotation


def marker_ops(events: list[TraceEvent]) -> dict[int, str]:
    """Correlation id of each marker's ``fill_`` -> the marker's label (``"7:forward_end"``): the ``aten::fill_``
    op inside each ``lit_ddp::mark::`` range of the CPU timeline, on the same thread."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    fills = [e for e in cpu if e.name == "aten::fill_"]
    found: dict[int, str] = {}
    for mark in (e for e in cpu if e.name.startswith(MARK_PREFIX)):
        for op in fills:
            if op.thread == mark.thread and mark.start_ms <= op.start_ms and op.end_ms <= mark.end_ms:
                found[op.correlation_id] = mark.name[len(MARK_PREFIX) :]
                break
    return found


def union_ms(intervals: Iterable[tuple[float, float]], start: float = -math.inf, end: float = math.inf) -> float:
    """Length of the union of (start, end) ``intervals`` inside ``[start, end]``: time something was busy."""
    clipped = sorted((max(s, start), min(e, end)) for s, e in intervals if e > start and s < end)
    total, cur_start, cur_end = 0.0, None, None
    for s, e in clipped:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class KernelRecorder:
    """Profiles CUDA kernels between ``start`` and ``stop``; ``mark(name)`` puts a boundary on the GPU timeline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marker = torch.zeros(1, device=device)
        self._profile: Optional[profile] = None
        self._count = 0

    def start(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profile.__enter__()

    @property
    def active(self) -> bool:
        return self._profile is not None

    def mark(self, name: str) -> None:
        self._count += 1
        with record_function(f"{MARK_PREFIX}{self._count}:{name}"):
            self._marker.fill_(self._count)

    def close(self) -> None:
        """Ends profiling; the trace is dropped (a failed fit), or read by ``stop``."""
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None

    def stop(self) -> tuple[list[tuple[str, float]], list[tuple[float, float]]]:
        """Ends profiling; returns the marks as (name, GPU time ms) in order, and every other kernel as
        (start ms, end ms), on the profiler's clock."""
        assert self._profile is not None, "start() first"
        prof = self._profile
        self.close()
        events = trace_events(prof)
        labels = marker_ops(events)
        marks, kernels = [], []
        for e in filter(is_gpu_work, events):
            label = labels.get(e.linked_correlation_id)
            if label is None:
                kernels.append((e.start_ms, e.end_ms))
            else:
                number, name = label.split(":", 1)
                marks.append((int(number), name, e.start_ms))
        return [(name, t) for _, name, t in sorted(marks)], kernels
