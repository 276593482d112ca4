"""GPU-busy time per phase: the interval arithmetic on hand-made kernels, and the profiler path where it runs."""

from dataclasses import astuple

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lit_ddp.callbacks.kernels import MARK_PREFIX, KernelRecorder, marker_ops, trace_events, union_ms
from lit_ddp.callbacks.phase_timer import _busy_per_step


def test_busy_is_the_union_of_kernels_clipped_to_the_window():
    kernels = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (9.0, 12.0)]
    assert union_ms(kernels, 0.0, 10.0) == pytest.approx(2.0 + 1.0 + 1.0)  # overlap counted once, tail clipped
    assert union_ms(kernels, 1.5, 3.5) == pytest.approx(0.5 + 0.5)
    assert union_ms(kernels, 5.0, 8.0) == 0.0  # idle window
    assert union_ms([], 0.0, 1.0) == 0.0
    assert union_ms([(0, 2), (1, 3), (5, 6)]) == 4  # unbounded: all of it


def step_marks(t0: float) -> list[tuple[str, float]]:
    return [(name, t0 + dt) for name, dt in (("start", 0), ("forward_start", 1), ("forward_end", 3),
            ("backward_start", 4), ("backward_end", 8), ("update_start", 9), ("update_end", 10),
            ("data_start", 11))]  # fmt: skip


def test_busy_per_step_splits_kernels_into_phases():
    marks = [*step_marks(0.0), *step_marks(12.0), ("start", 24.0)]
    # the first step: forward busy 1 of 2 ms, backward 4 of 4, update 0.5, plus 1 ms of kernels between phases
    kernels = [(1.0, 2.0), (4.0, 8.0), (9.0, 9.5), (10.5, 11.5), (13.0, 15.0)]
    rows = _busy_per_step(marks, kernels, range(2, 5))  # the i-th "start" marker opens the i-th profiled step
    assert [row.step for row in rows] == [2, 3]  # step 4 never ended: no "start" after its own
    # (forward, backward, update, other, step, data): the kernel at 10.5-11.5 is half other, half data
    assert astuple(rows[0].ms) == pytest.approx((1.0, 4.0, 0.5, 0.5, 6.5, 0.5))
    assert astuple(rows[1].ms) == pytest.approx((2.0, 0.0, 0.0, 0.0, 2.0, 0.0))
    # A step whose markers were not all found (a marker's kernel missing from the trace) is left out.
    missing = [m for m in marks if m != ("backward_end", 8.0)]
    assert [row.step for row in _busy_per_step(missing, kernels, range(2, 5))] == [3]


def test_markers_are_found_in_a_real_trace():
    """The CPU half of the marker lookup, on a real kineto trace (a CPU one here): each marker's fill_ op, by
    the correlation id its kernel links to on a GPU; other fill_ ops are not markers."""
    marker = torch.zeros(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, name in enumerate(["start", "forward_start"], 1):
            with record_function(f"{MARK_PREFIX}{i}:{name}"):
                marker.fill_(i)
            torch.ones(3).fill_(2)
    events = trace_events(prof)
    found = marker_ops(events)
    fills = {e.correlation_id: e for e in events if e.name == "aten::fill_"}
    assert sorted(found.values()) == ["1:start", "2:forward_start"]
    assert set(found) < set(fills) and len(fills) >= 4
    assert all(e.end_ms >= e.start_ms >= 0 for e in events)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_recorder_finds_its_markers_and_the_kernels_between_them():
    recorder = KernelRecorder(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    recorder.start()
    recorder.mark("start")
    for _ in range(5):
        a = a @ a / 2048
    recorder.mark("end")
    torch.cuda.synchronize()
    marks, kernels = recorder.stop()
    assert [name for name, _ in marks] == ["start", "end"]
    busy = union_ms(kernels, marks[0][1], marks[1][1])
    assert 0 < busy <= marks[1][1] - marks[0][1] + 1e-6
