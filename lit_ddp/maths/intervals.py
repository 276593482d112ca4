"""The union of intervals: how long something was busy (a GPU's ops in a trace, CommMonitor's buckets).

    union_length([(0, 2), (1, 3), (5, 6)])    # 4: the overlap counted once

On the floor below every reader (``lit_ddp.derive.trace``, ``lit_ddp.callbacks.comm_monitor``, the benchmarks),
with nothing of the tool's imported.
"""

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class Interval(NamedTuple):
    start: float
    end: float


def merge(intervals: Iterable[tuple[float, float]]) -> list[Interval]:
    """The union of (start, end) ``intervals`` as disjoint intervals in time order."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1].end:
            merged[-1] = Interval(merged[-1].start, max(merged[-1].end, end))
        else:
            merged.append(Interval(start, end))
    return merged


def length(merged: Sequence[Interval]) -> float:
    """The summed length of disjoint ``merged`` intervals (``merge``'s)."""
    return sum(i.end - i.start for i in merged)


def union_length(intervals: Iterable[tuple[float, float]], start: float = -math.inf, end: float = math.inf) -> float:
    """Length of the union of (start, end) ``intervals`` inside ``[start, end]``, in their unit: the time something
    was busy (also CommMonitor's communication time); an interval that ends before it starts counts for nothing."""
    clipped = ((max(s, start), min(e, end)) for s, e in intervals)
    # e >= s alike: an empty interval adds no length, and merged into another it moves neither end.
    return length(merge((s, e) for s, e in clipped if e > s))
