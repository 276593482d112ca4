"""PhaseTimer with a patched clock (every boundary), then on real 2-process runs: what a real run can promise, and
a run long enough for the record's running summaries to be checked against the exact per-step times."""

import csv
import gzip
import json
import re
import shutil
import statistics
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp._torch import optimizer_step_post_hooks
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.callbacks import LossMonitor, PhaseTimer
from lit_ddp.callbacks.comm_monitor import CommMonitor
from lit_ddp.callbacks.end_of_fit import EndOfFit
from lit_ddp.measure.clock import HostClock
from lit_ddp.measure.profiling import Ranges
from lit_ddp.present.phases import phase_table, roofline_table
from lit_ddp.records import schema as record
from lit_ddp.records.phases import range_of, with_step
from lit_ddp.records.ranges import STEP_PREFIX
from lit_ddp.records.schema import Roofline, Sketch
from lit_ddp.records.steps import HEAD_STEPS, TAIL_STEPS, is_steady
from lit_ddp.run.roles import NamesPendingCollective, ReportsOutOfMemory
from tests.records import phase_record
from tests.runner import PROFILE_RUN, ROOT, run_fit

PHASES = with_step()

BACKWARD = range_of("backward")
FORWARD = range_of("forward")
UPDATE = range_of("update")


class FakeTrainer(SimpleNamespace):
    """Just what PhaseTimer touches: a CPU strategy, rank 0 of a world of 1 (its record goes nowhere but to its
    own log dir), no logger, no profiler of Lightning's."""

    def __init__(self, model, log_dir):
        strategy = SimpleNamespace(root_device=torch.device("cpu"), model=model)
        super().__init__(strategy=strategy, is_global_zero=True, global_rank=0, world_size=1, loggers=[],
                         global_step=0, log_dir=str(log_dir), callbacks=[], progress_bar_callback=None,
                         precision="32-true", optimizers=[torch.optim.Adam(model.parameters())],
                         profiler=None, log_every_n_steps=50, node_rank=0)  # fmt: skip

    def train_end(self, model, *callbacks):
        """Lightning's ``on_train_end``: ``callbacks``' first, then the ``EndOfFit`` they added (it saves)."""
        for callback in [*callbacks, *(c for c in self.callbacks if isinstance(c, EndOfFit))]:
            callback.on_train_end(self, model)


def drive_one_step(timer, trainer, model, clock):
    """The hooks in Lightning's order, with the clock set before each; returns the boundary times."""
    batch = (torch.zeros(4, 8), torch.zeros(4, 8))
    opt = trainer.optimizers[0]
    timer.on_train_batch_start(trainer, model, batch, 0)
    t0 = clock.now  # after the hook: whatever it cost (starting a profiler) is before the step
    timer._on_forward_start(model, (batch,))  # the forward pre-hook, at once (Lightning's batch work: none here)
    clock.now = t0 + 0.010  # forward: 10 ms
    timer.on_before_zero_grad(trainer, model, opt)
    clock.now = t0 + 0.011  # zero_grad: 1 ms -> other
    timer.on_before_backward(trainer, model, torch.tensor(1.0))
    clock.now = t0 + 0.031  # backward: 20 ms
    timer.on_after_backward(trainer, model)
    clock.now = t0 + 0.033  # 2 ms between -> other
    timer.on_before_optimizer_step(trainer, model, opt)
    clock.now = t0 + 0.038  # update: 5 ms
    timer._on_optimizer_step_end(opt, (), {})
    trainer.global_step += 1
    clock.now = t0 + 0.040  # 2 ms to the batch end -> other
    timer.on_train_batch_end(trainer, model, {"loss": torch.tensor(1.0)}, batch, 0)
    clock.now = t0 + 0.100  # the loop, the next batch and later callbacks until the next step starts -> data


def test_every_boundary_with_a_patched_clock(monkeypatch, tmp_path, caplog):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model = LinearRegression(dim=8)
    trainer = FakeTrainer(model, tmp_path)
    timer = PhaseTimer(print_steps=1)
    timer.on_train_start(trainer, model)
    with caplog.at_level("INFO"):
        for _ in range(3):
            drive_one_step(timer, trainer, model, clock)
        trainer.train_end(model, timer)  # the last step ends here, at t0 + 0.100
    phases = record.load(tmp_path / "phases.json")
    assert phases.steps == [0, 1, 2]
    assert (phases.meta.world_size, phases.meta.clock) == (1, "perf_counter")
    for row in phases.ranks[0].rows:
        assert (row.ms.forward, row.ms.backward, row.ms.update) == pytest.approx((10.0, 20.0, 5.0), abs=1e-6)
        assert row.ms.other == pytest.approx(5.0, abs=1e-6)  # zero_grad 1 + gap 2 + to the batch end 2
        assert row.ms.data == pytest.approx(60.0, abs=1e-6)  # batch end -> next step's start
        assert row.ms.step == pytest.approx(100.0, abs=1e-6)
        # where each of record.BOUNDARIES fell, from the step's start
        assert list(row.offsets_ms.values()) == pytest.approx(
            [0.0, 10.0, 11.0, 31.0, 33.0, 38.0, 40.0, 100.0], abs=1e-6
        )
    # each step's start on the host clock (the timeline's): one step ends where the next one starts
    assert [row.start_s for row in phases.ranks[0].rows] == pytest.approx([100.0, 100.1, 100.2], abs=1e-9)
    assert phases.ended_by is None
    summaries = phases.ranks[0].summaries
    assert {p: summaries[p].count for p in PHASES} == dict.fromkeys(PHASES, 2)  # steps 1-2: step 0 is warm-up
    assert summaries["backward"].median == pytest.approx(20.0, rel=Sketch.RELATIVE_ACCURACY)
    assert "Step 0\n forward : 10.00 ms\n backward: 20.00 ms\n update  : 5.00 ms" in caplog.text
    assert "Step 1\n" not in caplog.text  # print_steps=1
    assert "Phase times (perf_counter: host time), 1 rank(s)" in caplog.text


def test_the_window_is_resolved_every_log_every_n_steps_not_in_every_step(monkeypatch, tmp_path):
    """The marks of ended steps wait, and are turned into rows (one logger row a step, at its step) in one go
    once log_every_n_steps of them are pending, and at the end; the first print_steps steps are resolved at once,
    for their printed blocks."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model = LinearRegression(dim=8)
    logged = []
    trainer = FakeTrainer(model, tmp_path)
    trainer.log_every_n_steps = 3
    trainer.loggers = [SimpleNamespace(log_metrics=lambda metrics, step: logged.append(step))]
    timer = PhaseTimer(print_steps=1)
    timer.on_train_start(trainer, model)
    seen = []
    for _ in range(7):
        drive_one_step(timer, trainer, model, clock)
        seen.append(list(logged))
    trainer.train_end(model, timer)
    # Step 0 resolved at step 1's start, for its printed block; steps 1-3 at step 4's (3 pending), the rest at
    # the end.
    assert seen == [[], [0], [0], [0], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert logged == [*range(7), 7]  # then the end of fit's row (lit_ddp.present.loggers), at global_step 7


class HostClockAsCuda(HostClock):
    name = "cuda_event"  # so that PhaseTimer records kernels; the marks stay on the patched host clock


class StandInRecorder:
    """TraceRecorder on the patched host clock (no GPU here): starting and stopping cost 1 s, as CUPTI's start-up
    and writing the trace can. Its ranges are PhaseTimer's real ones (``profiling.Ranges``), timed on the clock;
    each forward, backward and update range queues one 2 ms "kernel" as it opens. ``stop`` writes all of it as the
    Chrome trace a GPU run would write, which PhaseTimer then reads through ``lit_ddp.derive.trace``."""

    owns_profiler = True

    def __init__(self, clock, path, rank):
        self.clock, self.path, self.rank, self.where = clock, path, rank, path.parent
        self.active, self.closed, self.events = False, False, []
        self.ranges = Ranges(self._enter)

    def _enter(self, name):
        us = self.clock.now * 1e6
        event = {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": us, "dur": 0.0}
        self.events.append(event)
        if name in (FORWARD, BACKWARD, UPDATE):
            correlation = len(self.events)
            self.events += [
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": us + 1, "dur": 1,
                 "args": {"correlation": correlation}},
                {"ph": "X", "cat": "kernel", "name": "gemm", "ts": us + 2, "dur": 2000,
                 "args": {"correlation": correlation, "stream": 7}},
            ]  # fmt: skip
        return SimpleNamespace(__exit__=lambda *exc: event.update(dur=self.clock.now * 1e6 - us))

    def start(self):
        self.active = True
        self.clock.now += 1.0

    def begin_step(self, step):
        self.ranges.begin_step(step)

    def mark(self, boundary):
        self.ranges.mark(boundary)

    def stop(self):
        self.close()
        self.closed = False
        self.clock.now += 1.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        trace = {"distributedInfo": {"rank": self.rank, "world_size": 1}, "traceEvents": self.events}
        self.path.write_bytes(gzip.compress(json.dumps(trace).encode()))
        return [self.path]

    def close(self):
        self.ranges.close()
        self.active, self.closed = False, True


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """A patched host clock that PhaseTimer takes for CUDA events, and the recorder it then builds."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    monkeypatch.setattr("lit_ddp.callbacks.phase_timer.clock_for", lambda device: HostClockAsCuda())
    monkeypatch.setattr("lit_ddp.callbacks.phase_timer.TraceRecorder",
                        lambda device, path, rank: StandInRecorder(clock, path, rank))  # fmt: skip
    return clock


def drive_steps(clock, tmp_path, kernel_steps: int, steps: int):
    """A PhaseTimer(kernel_steps) on the fake trainer, driven through ``steps`` steps; (timer, trainer, model)."""
    model = LinearRegression(dim=8)
    trainer = FakeTrainer(model, tmp_path)
    timer = PhaseTimer(kernel_steps=kernel_steps)
    timer.on_train_start(trainer, model)
    for _ in range(steps):
        drive_one_step(timer, trainer, model, clock)
    return timer, trainer, model


def test_profiler_start_and_stop_are_in_no_step(stand_in_gpu, tmp_path, caplog):
    """The profiler starts before the first profiled step and stops after the last; its cost must land in no
    step's time. The GPU-busy rows come from the trace it wrote, through lit_ddp.derive.trace."""
    timer, trainer, model = drive_steps(stand_in_gpu, tmp_path, kernel_steps=2, steps=6)
    with caplog.at_level("INFO"):
        trainer.train_end(model, timer)
    trace = json.loads(gzip.decompress((tmp_path / "traces" / "rank0.pt.trace.json.gz").read_bytes()))
    steps = [e["name"] for e in trace["traceEvents"] if e["name"].startswith(STEP_PREFIX)]
    assert steps == [f"{STEP_PREFIX}2", f"{STEP_PREFIX}3"]  # opened and closed between steps, profiled ones only
    assert f"PhaseTimer: steps 2-3 profiled; every rank's trace is in {tmp_path / 'traces'}" in caplog.text
    phases = record.load(tmp_path / "phases.json")
    assert phases.steps == [0, 1, 2, 3, 4, 5]
    assert [row.ms.step for row in phases.ranks[0].rows] == pytest.approx([100.0] * 6, abs=1e-6)
    busy = phases.ranks[0].busy_ms
    assert [row.step for row in busy] == [2, 3]
    figures = [(row.ms.forward, row.ms.backward, row.ms.update, row.ms.other, row.ms.step, row.ms.data) for row in busy]
    assert figures == [pytest.approx((2.0, 2.0, 2.0, 0.0, 6.0, 0.0))] * 2  # one 2 ms kernel queued per phase
    assert phases.profiled_steps == [2, 3]
    assert phases.ranks[0].summaries["step"].count == 3  # steps 1, 4 and 5: not the profiled ones
    table = phase_table(analyze(phases, None))
    assert ("then 3 steady step(s) (steps 2-3 ran under the profiler for the GPU-busy column, left out of the "
            "others):") in table  # fmt: skip
    assert table.endswith("Verdict: host-bound: the GPU was busy 6% of the step (6% to 6% in the 2 profiled steps); "
                          "larger batches, fewer kernel "
                          "launches (fused Adam, CUDA graphs) or less per-step Python would help")  # fmt: skip


def test_a_profile_that_measured_nothing_says_so():
    # Steps 2-4 were to be profiled, the run ended after step 3, and no GPU-busy row came back.
    phases = phase_record([[(1.0, 2.0, 1.0, 1.0)] * 4], profiled=[2, 3, 4], clock="cuda_event")
    table = phase_table(analyze(phases, None))
    assert ("then 1 steady step(s) (steps 2-3 ran under the profiler without completing a GPU-busy measurement, "
            "left out of the others):") in table  # fmt: skip
    assert "GPU busy" not in table
    assert table.endswith("Verdict: unknown: GPU-busy time was not measured (no profiled step completed)")


def test_a_failed_fit_leaves_no_profiler_and_no_hook(stand_in_gpu, tmp_path):
    timer, trainer, model = drive_steps(stand_in_gpu, tmp_path, kernel_steps=3, steps=3)
    assert timer._fit.recorder.active and model._forward_pre_hooks
    timer.on_exception(trainer, model, RuntimeError("a rank failed"))
    assert timer._fit.recorder.closed and not timer._fit.recorder.active
    assert not model._forward_pre_hooks and not optimizer_step_post_hooks(trainer.optimizers[0])


def test_update_ends_at_batch_end_without_the_post_hook(monkeypatch, tmp_path):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model = LinearRegression(dim=8)
    trainer = FakeTrainer(model, tmp_path)
    timer = PhaseTimer()
    timer.on_train_start(trainer, model)
    timer._handles[1].remove()  # as if the optimizer had no post-hook support
    timer._on_optimizer_step_end = lambda *a: None
    drive_one_step(timer, trainer, model, clock)
    timer._fit._close_step(timer._fit.clock.mark())
    timer._resolve(trainer, block=True)
    (step_0,) = [row for step, row in timer._fit.window.items() if step == 0]
    forward, backward, update, other, step, data = (
        step_0.ms[p] for p in ("forward", "backward", "update", "other", "step", "data")
    )
    assert update == pytest.approx(7.0)  # update_start -> batch end
    assert forward + backward + update + data + other == pytest.approx(step)


def test_roofline_fraction_of_peak():
    roof = Roofline(rows_per_rank=8, forward_flop=2e9, backward_flop=2e9, update_bytes=1e9, peak_tflops=2.0,
                    peak_gbps=2000.0)  # fmt: skip
    table = roofline_table(phase_record([[(0, 0, 0, 0), (2.0, 4.0, 1.0, 0.0)]], roofline=roof))
    # 2 GFLOP in 2 ms, of 2 TFLOP/s; in 4 ms; 1 GB in 1 ms, of 2000 GB/s (units by magnitude)
    assert re.search(r"^forward\s+2.00 GFLOP\s+2.00 ms\s+1.00 TFLOP/s\s+50.0%$", table, re.M), table
    assert re.search(r"^backward\s+2.00 GFLOP\s+4.00 ms\s+500.0 GFLOP/s\s+25.0%$", table, re.M), table
    assert re.search(r"^update\s+1.00 GB\s+1.00 ms\s+1.00 TB/s\s+50.0%$", table, re.M), table
    # A bandwidth as every bandwidth the tool prints, to three significant figures: 355.6 kB in 1 ms.
    roof = Roofline(rows_per_rank=8, forward_flop=2e9, backward_flop=2e9, update_bytes=355_600)
    table = roofline_table(phase_record([[(0, 0, 0, 0), (2.0, 4.0, 1.0, 0.0)]], roofline=roof))
    assert re.search(r"^update\s+355.6 kB\s+1.00 ms\s+356 MB/s\s+-$", table, re.M), table


def test_kernel_steps_on_cpu_profile_the_cpu_and_keep_the_trace(monkeypatch, tmp_path, caplog):
    """An explicit kernel_steps without CUDA: torch.profiler over the CPU only (real, in this process), its trace
    kept with PhaseTimer's ranges; no GPU events, so no GPU-busy rows, said once; the profiled steps are left out."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model = LinearRegression(dim=8)
    trainer = FakeTrainer(model, tmp_path)
    timer = PhaseTimer(kernel_steps=2)
    timer.on_train_start(trainer, model)
    with caplog.at_level("INFO"):
        for _ in range(5):
            drive_one_step(timer, trainer, model, clock)
        trainer.train_end(model, timer)
    phases = record.load(tmp_path / "phases.json")
    assert phases.profiled_steps == [2, 3] and phases.ranks[0].summaries["step"].count == 2  # steps 1 and 4
    assert phases.ranks[0].busy_ms == []
    assert caplog.text.count("CPU activity only: the traces hold no GPU events, so there is no GPU-busy column") == 1
    trace = json.loads(gzip.decompress((tmp_path / "traces" / "rank0.pt.trace.json.gz").read_bytes()))
    names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert [n for n in names if n.startswith(STEP_PREFIX)] == [f"{STEP_PREFIX}2", f"{STEP_PREFIX}3"]
    assert {FORWARD, BACKWARD, UPDATE, "lit_ddp.data", "lit_ddp.other"} <= set(names)
    assert "GPU busy" not in phase_table(analyze(phases, None))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="print_steps=-1"):
        PhaseTimer(print_steps=-1)
    with pytest.raises(ValueError, match="peak_tflops=0"):
        PhaseTimer(peak_tflops=0)


def test_real_run_phases_add_up_and_are_logged(make_trainer, tmp_path):
    """On 2 real ranks, what a real run can promise: every phase > 0 and the phases add up to the step."""
    trainer = make_trainer(max_steps=4, callbacks=[PhaseTimer()], logger=CSVLogger(tmp_path, name="run", version=0))
    trainer.fit(LinearRegression(dim=256), FixedBatchDataModule(dim=256, batch_size=8))
    log_dir = tmp_path / "run" / "version_0"
    phases, _ = record.load_run(log_dir)
    assert phases.meta.world_size == 2 and [rank.rank for rank in phases.ranks] == [0, 1]
    for rank in phases.ranks:
        assert [row.step for row in rank.rows] == [0, 1, 2, 3]
        assert rank.summaries["step"].count == 3  # steps 1-3
        for row in rank.rows:
            ms = row.ms
            assert min(ms.forward, ms.backward, ms.update, ms.step) > 0
            assert ms.forward + ms.backward + ms.update + ms.data + ms.other == pytest.approx(ms.step, abs=1e-6)
            assert ms.other >= -1e-6 and ms.data > 0
            marks = list(row.offsets_ms.values())
            assert marks == sorted(marks) and row.offsets_ms["end"] == pytest.approx(ms.step)
    metrics = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"time/forward_ms", "time/backward_ms", "time/update_ms", "time/step_ms"} <= set(metrics)


@pytest.mark.timeout(60)
def test_real_run_summaries_agree_with_the_exact_medians(make_trainer, tmp_path):
    """A 2-rank run as long as the window (HEAD_STEPS + TAIL_STEPS steps: every step's detail is kept): the
    medians of the record's running summaries agree with the exact medians of the steady steps. The exact times:
    rank 0's as PhaseTimer logged them every step (metrics.csv), rank 1's from its kept rows."""
    steps = HEAD_STEPS + TAIL_STEPS
    trainer = make_trainer(max_steps=steps, callbacks=[PhaseTimer(print_steps=0)],
                           logger=CSVLogger(tmp_path, name="run", version=0))  # fmt: skip
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=8))
    log_dir = tmp_path / "run" / "version_0"
    phases = record.load(log_dir / "phases.json")
    with open(log_dir / "metrics.csv") as f:
        logged = {int(r["step"]): r for r in csv.DictReader(f) if r.get("time/step_ms")}
    assert sorted(logged) == list(range(steps))
    assert all([row.step for row in rank.rows] == list(range(steps)) for rank in phases.ranks)
    for row in phases.ranks[0].rows:  # the record keeps what was logged
        logged_ms = [float(logged[row.step][f"time/{p}_ms"]) for p in PHASES]
        assert [getattr(row.ms, p) for p in PHASES] == pytest.approx(logged_ms)
    exact = {
        0: {p: [float(r[f"time/{p}_ms"]) for s, r in logged.items() if is_steady(s)] for p in PHASES},
        1: {p: [getattr(row.ms, p) for row in phases.ranks[1].rows if is_steady(row.step)] for p in PHASES},
    }
    for rank in phases.ranks:
        for p in PHASES:
            summary = rank.summaries[p]
            assert summary.count == steps - 1, (rank.rank, p)
            assert summary.median == pytest.approx(statistics.median(exact[rank.rank][p]), rel=0.02), (rank.rank, p)
            assert (summary.min, summary.max) == (min(exact[rank.rank][p]), max(exact[rank.rank][p]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_the_device_not_the_host(tmp_path):
    """A matmul queued between two marks: CUDA events see its device time, without a synchronize in between."""
    from lit_ddp.measure.clock import CudaClock

    clock = CudaClock()
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start = clock.mark()
    for _ in range(10):
        a = a @ a / 4096
    end = clock.mark()
    clock.wait(end)
    assert clock.ready(end)
    assert clock.elapsed_ms(start, end) > 0.1


@pytest.mark.timeout(30)
def test_the_strategy_finds_the_callbacks_by_their_declared_roles():
    """``LitDDPStrategy`` looks callbacks up by ``lit_ddp.run.roles``' Protocols, not by a method name it guesses."""
    assert isinstance(PhaseTimer(), ReportsOutOfMemory) and not isinstance(PhaseTimer(), NamesPendingCollective)
    assert isinstance(CommMonitor(), NamesPendingCollective) and not isinstance(CommMonitor(), ReportsOutOfMemory)
    assert not isinstance(LossMonitor(), ReportsOutOfMemory) and not isinstance(LossMonitor(), NamesPendingCollective)


def test_every_optimizer_is_hooked_so_a_second_one_is_no_skipped_update(monkeypatch, tmp_path):
    """Manual optimization with two optimizers under a grad scaler: both steps ran, so no update was skipped (with
    the first optimizer alone hooked, every step read as skipped)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model = LinearRegression(dim=8)
    trainer = FakeTrainer(model, tmp_path)
    trainer.optimizers = [
        torch.optim.SGD(model.net[0].parameters(), lr=0.1),
        torch.optim.SGD([model.net[0].bias], lr=0.1),
    ]
    trainer.precision_plugin = SimpleNamespace(scaler=object())  # 16-mixed: a scaler may skip an update
    timer = PhaseTimer()
    timer.on_train_start(trainer, model)
    assert all(optimizer_step_post_hooks(opt) for opt in trainer.optimizers)
    batch = (torch.zeros(4, 8), torch.zeros(4, 8))
    for _ in range(3):
        timer.on_train_batch_start(trainer, model, batch, 0)
        timer._on_forward_start(model, (batch,))
        timer.on_before_backward(trainer, model, torch.tensor(1.0))
        clock.now += 0.01
        timer.on_after_backward(trainer, model)
        for opt in trainer.optimizers:
            timer.on_before_optimizer_step(trainer, model, opt)
            opt.step()  # the real post-hooks run
            trainer.global_step += 1  # manual optimization: one step per optimizer step
        clock.now += 0.01
        timer.on_train_batch_end(trainer, model, None, batch, 0)
    trainer.train_end(model, timer)
    phases = record.load(tmp_path / "phases.json")
    assert (phases.skipped_count, phases.steps) == (0, [0, 2, 4])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_fit_resumed_from_last_ckpt_warms_up_and_profiles_its_own_steps(tmp_path):
    """The profile config run for 10 steps, then resumed from its last.ckpt for 10 more: the resumed fit's warm-up
    is its own first step (10), it profiles 12-14 and has the memory columns, and its record says so."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    args = (*PROFILE_RUN, "--checkpoint.every_n_steps", "10")
    first = run_fit(*args, cwd=tmp_path, timeout=190)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_fit(*args, "--trainer.max_steps", "20", "--ckpt_path", "last", "--detail", cwd=tmp_path, timeout=190)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = resumed.stdout
    run_dir = tmp_path / "runs" / "mini_train_profile" / "version_1"
    assert "Step 10\n forward : " in out and "Step 9\n" not in out  # print_steps: the fit's first 3
    assert "PhaseTimer: steps 12-14 profiled, CPU activity only" in out, out[-3000:]
    assert ("2 rank(s), step 10 = warm-up (the fit resumed there), then 6 steady step(s) (steps 12-14 ran under the "
            "profiler for the memory columns, left out of the others):\nphase       step 10  ") in out  # fmt: skip
    assert re.search(r"^phase +step 10 +median .* peak memory +retained$", out, re.M), out[-3000:]
    # The highest rank's bytes (--detail's memory legend): either rank's, as the CPU allocator's events fall on the
    # two (rank 1's in one CI run)
    assert re.search(r"^Memory \(rank [01], the highest; steps 13-14;", out, re.M), out[-3000:]
    phases = record.load(run_dir / "phases.json")
    assert (phases.first_step, phases.profiled_steps, phases.steps) == (10, [12, 13, 14], list(range(10, 20)))
    assert [row.step for row in phases.steady_rows()] == [11, 15, 16, 17, 18, 19]
    assert phases.memory_source == "cpu_profiler" and [m.step for m in phases.ranks[0].memory] == [13, 14]
    assert phases.roofline.flop_source == "FlopCounterMode, step 10" and phases.roofline.forward_flop > 0
    assert sorted(p.name for p in (run_dir / "traces").iterdir()) == [f"rank{r}.pt.trace.json.gz" for r in (0, 1)]
    first_phases = record.load(run_dir.parent / "version_0" / "phases.json")  # the first fit: its own steps
    assert (first_phases.first_step, first_phases.profiled_steps) == (0, [2, 3, 4])


class RaiseAfterStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step - 1 == self.step:
            raise RuntimeError(f"failed after step {self.step}")


@pytest.mark.parametrize(
    ("callback", "column", "ranks"),
    [(PhaseTimer, "time/forward_ms", {"devices": 1, "spawn": False}), (CommMonitor, "comm/bytes", {})],
    ids=["PhaseTimer, one rank in this process", "CommMonitor, 2 forked ranks"],
)
def test_a_failed_fit_logs_its_windows_finished_steps(make_trainer, tmp_path, callback, column, ranks):
    """Lightning's cadence holds the rows for 50 steps; a fit that fails in step 29's batch end still logs steps
    0-28, whose marks ended (a step ends at the next one's start). Forked ranks' callbacks hear of the exception
    from the tool's launcher (``lit_ddp.run.spawn_launcher.CarryBackLauncher``), as Lightning tells ``ddp``'s and
    torchrun's; the launching process, which never set them up, hears of it too."""
    trainer = make_trainer(max_steps=100, callbacks=[callback(), RaiseAfterStep(29)],
                           logger=CSVLogger(tmp_path, name="run", version=0), **ranks)  # fmt: skip
    with pytest.raises(Exception, match="failed after step 29"):
        trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f) if row.get(column)] == list(range(29))
