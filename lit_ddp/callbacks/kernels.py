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
from typing import Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

MARK_PREFIX = "lit_ddp::mark::"


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

    def stop(self) -> tuple[list[tuple[str, float]], list[tuple[float, float]]]:
        """Ends profiling; returns the marks as (name, GPU time ms) in order, and every other kernel as
        (start ms, end ms), on the profiler's clock."""
        assert self._profile is not None, "start() first"
        self._profile.__exit__(None, None, None)
        events = self._profile.events()
        self._profile = None
        # A marker's record_function range holds the fill_ op; the fill_ op's correlation id links the kernel.
        ranges = [
            (e.name[len(MARK_PREFIX) :], e.time_range, e.thread) for e in events if e.name.startswith(MARK_PREFIX)
        ]
        ops = [e for e in events if e.device_type == DeviceType.CPU and e.name == "aten::fill_"]
        marker_ops: dict[int, str] = {}
        for label, span, thread in ranges:
            for op in ops:
                if op.thread == thread and span.start <= op.time_range.start and op.time_range.end <= span.end:
                    marker_ops[op.id] = label
                    break
        marks, kernels = [], []
        for e in events:
            # GPU user annotations (record_function ranges drawn on the GPU timeline) span the gaps between
            # kernels: they are not work. torch's own device totals leave them out too.
            if e.device_type != DeviceType.CUDA or e.is_user_annotation:
                continue
            interval = (e.time_range.start / 1e3, e.time_range.end / 1e3)
            label = marker_ops.get(e.linked_correlation_id)
            if label is None:
                kernels.append(interval)
            else:
                marks.append((int(label.split(":")[0]), label.split(":", 1)[1], interval[0]))
        return [(name, t) for _, name, t in sorted(marks)], kernels
