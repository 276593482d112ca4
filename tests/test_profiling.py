"""PhaseTimer's profiling helper: its ranges (their order and nesting, by hand and in a real CPU profile), GPU-busy
rows read from hand-made traces through lit_ddp.derive.trace, what it says, the interval arithmetic, and the CUDA path
where it runs."""

import gzip
import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lit_ddp.derive import trace
from lit_ddp.measure.profiling import Busy, Ranges, TraceRecorder, describe, read_busy

pytestmark = pytest.mark.timeout(60)

BOUNDARIES = ("forward_start", "forward_end", "backward_start", "backward_end", "update_start", "update_end",
              "data_start")  # fmt: skip
# The phase ranges of one step, in order: "other" between the phases.
ONE_STEP = ["lit_ddp.other", "lit_ddp.forward", "lit_ddp.other", "lit_ddp.backward", "lit_ddp.other", "lit_ddp.update",
            "lit_ddp.other", "lit_ddp.data"]  # fmt: skip


class Log:
    """An ``enter`` for ``Ranges`` that logs what opens and closes."""

    def __init__(self):
        self.log = []

    def __call__(self, name):
        self.log.append(("open", name))
        log = self.log

        class Opened:
            def __exit__(self, *exc):
                log.append(("close", name))

        return Opened()


def test_ranges_keep_one_phase_open_inside_each_step_and_close_in_nesting_order():
    log = Log()
    ranges = Ranges(log)
    ranges.mark("forward_start")  # before any step: nothing to mark
    ranges.begin_step(2)
    for boundary in BOUNDARIES:
        ranges.mark(boundary)
    ranges.mark("start")  # not a phase boundary
    ranges.begin_step(3)  # ends step 2 first
    ranges.close()
    ranges.close()  # twice is harmless
    opened = [name for what, name in log.log if what == "open"]
    assert opened == [f"{trace.STEP_PREFIX}2", *ONE_STEP, f"{trace.STEP_PREFIX}3", "lit_ddp.other"]
    depth = []  # every close is of the innermost open range
    for what, name in log.log:
        if what == "open":
            depth.append(name)
        else:
            assert depth.pop() == name
    assert depth == []


def test_ranges_reach_a_real_cpu_trace_nested_and_tiling_the_step(tmp_path):
    ranges = Ranges()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ranges.begin_step(7)
        for boundary in BOUNDARIES:
            ranges.mark(boundary)
            torch.ones(64) @ torch.ones(64)
        ranges.close()
    path = tmp_path / "rank0.pt.trace.json.gz"
    prof.export_chrome_trace(str(path))
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # torch gzips a .gz path
    loaded = trace.load(path)
    (step,) = [r for r in loaded.ranges if r.name.startswith(trace.STEP_PREFIX)]
    phases = [r for r in loaded.ranges if r is not step]
    assert step.name == f"{trace.STEP_PREFIX}7" and [r.name for r in phases] == ONE_STEP
    assert all(step.start_us <= r.start_us and r.end_us <= step.end_us for r in phases)
    for before, after in zip(phases, phases[1:], strict=False):  # each opens as the one before closes
        assert 0 <= after.start_us - before.end_us < 1000


def event(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def write_trace(path: Path, rank: int, ranges=(), kernels=()) -> Path:
    """``ranges``: (name, start, dur); ``kernels``: (queued at, start, dur), each linked to its launch."""
    events = [event("user_annotation", name, ts, dur) for name, ts, dur in ranges]
    for i, (queued, start, dur) in enumerate(kernels):
        events += [event("cuda_runtime", "cudaLaunchKernel", queued, 1, correlation=i),
                   event("kernel", "gemm", start, dur, correlation=i, stream=7)]  # fmt: skip
    data = {"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    return path


def step_ranges(step, t0):
    """Step ``step`` over [t0, t0 + 100): forward [t0, t0+20), backward [t0+20, t0+50), update [t0+50, t0+60), other
    [t0+60, t0+70), data [t0+70, t0+100)."""
    return [(f"{trace.STEP_PREFIX}{step}", t0, 100), ("lit_ddp.forward", t0, 20), ("lit_ddp.backward", t0 + 20, 30),
            ("lit_ddp.update", t0 + 50, 10), ("lit_ddp.other", t0 + 60, 10), ("lit_ddp.data", t0 + 70, 30)]  # fmt: skip


def test_busy_rows_give_each_op_to_the_phase_that_queued_it(tmp_path):
    # Step 2: a forward op queued at 5 runs at 30-40 (under backward on the GPU); a backward op queued at 25 runs
    # 45-75 (into the update's time); the update's op 80-90; data's 95-100. Step 3: one backward op.
    kernels = [(5, 30, 10), (25, 45, 30), (55, 80, 10), (75, 95, 5), (125, 130, 10)]
    mine = write_trace(tmp_path / "a.json.gz", 0, [*step_ranges(2, 0), *step_ranges(3, 100)], kernels)
    other_rank = write_trace(tmp_path / "b.json.gz", 1, step_ranges(2, 0), kernels)
    not_ours = write_trace(tmp_path / "c.json.gz", 0, [("ProfilerStep#2", 0, 100)], kernels)
    junk = tmp_path / "d.json"
    junk.write_text("not a trace")
    busy = read_busy([mine, other_rank, not_ours, junk], rank=0, steps=range(2, 4))
    assert busy.traces == [mine] and busy.gpu
    assert [row.step for row in busy.rows] == [2, 3]
    two = busy.rows[0].ms
    assert (two.forward, two.backward, two.update, two.data, two.other) == pytest.approx((0.01, 0.03, 0.01, 0.005, 0))
    assert two.step == pytest.approx(0.055)  # the union: 30-40, 45-75, 80-90, 95-100 us
    three = busy.rows[1].ms
    assert (three.forward, three.backward, three.step) == pytest.approx((0.0, 0.01, 0.01))
    assert [row.step for row in read_busy([mine], rank=0, steps=range(3, 5)).rows] == [3]
    # Lightning's profiler stops inside a step: without PhaseTimer's own steps, a trace's last one is left out.
    assert [row.step for row in read_busy([mine], rank=0, steps=None).rows] == [2]


def test_a_cpu_only_trace_gives_no_rows_and_says_so(tmp_path):
    cpu = write_trace(tmp_path / "rank0.json.gz", 0, step_ranges(2, 0))
    assert read_busy([cpu], rank=0, steps=range(2, 3)) == read_busy([cpu], rank=0) == Busy([], [cpu], False)


def test_what_phase_timer_says(tmp_path):
    where = tmp_path / "traces"
    gpu, cpu, none = Busy(["a row"], [where / "x"], True), Busy([], [where / "x"], False), Busy([], [], False)
    assert describe(gpu, where, range(2, 5)) == (f"PhaseTimer: steps 2-4 profiled; every rank's trace is in {where} "
                                                 f"(python -m lit_ddp.report --trace {where})")  # fmt: skip
    assert "step 2 profiled, CPU activity only: the traces hold no GPU events" in describe(cpu, where, range(2, 3))
    assert describe(cpu, where) == (f"PhaseTimer: 1 trace(s) of Lightning's PyTorchProfiler in {where} hold no GPU "
                                    "events (a CPU-only profile), so there is no GPU-busy column")  # fmt: skip
    assert describe(gpu, where).startswith("PhaseTimer: GPU-busy time of 1 step(s) from 1 trace(s) of Lightning's")
    assert describe(none, where).startswith("PhaseTimer: no trace of Lightning's PyTorchProfiler with PhaseTimer's")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_recorder_writes_a_trace_whose_phases_hold_their_kernels(tmp_path):
    recorder = TraceRecorder(torch.device("cuda"), tmp_path / "traces" / "rank0.pt.trace.json.gz", rank=0)
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    recorder.start()
    recorder.begin_step(2)
    recorder.mark("forward_start")
    for _ in range(5):
        a = a @ a / 2048
    recorder.mark("forward_end")
    busy = read_busy(recorder.stop(), rank=0, steps=range(2, 3))
    assert busy.gpu and [row.step for row in busy.rows] == [2]
    row = busy.rows[0].ms
    assert row.forward > 0 and row.step >= row.forward and row.backward == 0
    loaded = trace.load(recorder.path)
    assert sum(op.kind == "compute" for op in loaded.ops) >= 5


def test_torch_profilers_own_chatter_is_hidden_and_every_other_line_kept(capfd):
    """torch's profiler prints "USDT: ... profiler_start" (and on a CUDA build without a GPU "ERROR: ...
    gpuGetDeviceCount failed") on stderr from C++ as it starts and stops; a line of anyone else's goes through."""
    import os

    from lit_ddp.measure.profiling import profiler_chatter_hidden

    with profiler_chatter_hidden():
        os.write(2, b"USDT:2026-12-01 20:49:52 11466:11466 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(
            2, b"ERROR:2026-12-01 21:47:53 30207:30207 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n"
        )
        os.write(2, b"a line of the user's\n")
    assert capfd.readouterr().err == "a line of the user's\n"
