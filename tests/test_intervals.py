"""The union of intervals (``lit_ddp.maths.intervals.merge``, ``union_length``): the trace analysis's busy time,
CommMonitor's communication time and the GPU check's reference figures."""

import pytest

from lit_ddp.maths.intervals import Interval, merge, union_length


def test_merge_joins_overlapping_and_touching_intervals_in_time_order():
    assert merge([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0)]) == [Interval(0.0, 4.0), Interval(5.0, 6.0)]
    assert merge([]) == []


def test_busy_is_the_union_of_intervals_clipped_to_the_window():
    kernels = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (9.0, 12.0)]
    assert union_length(kernels, 0.0, 10.0) == pytest.approx(2.0 + 1.0 + 1.0)  # overlap counted once, tail clipped
    assert union_length(kernels, 1.5, 3.5) == pytest.approx(0.5 + 0.5)
    assert union_length(kernels, 5.0, 8.0) == 0.0  # idle window
    assert union_length([], 0.0, 1.0) == 0.0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4  # unbounded: all of it
    assert union_length([(0, 2), (4, 3)]) == 2  # one that ends before it starts counts for nothing
