"""Memory: DDP's own bytes exactly as its layout, what gradient_as_bucket_view gives back, per-phase peaks of a
model whose activations are known, the CUDA allocator's marks, and the line of a rank that runs out of memory.

Two real 2-rank ``ddp_spawn`` runs (module-scoped: one without and one with ``gradient_as_bucket_view``) feed
most tests; the rest are hand-driven."""

import csv
import gzip
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lit_ddp import FixedBatchDataModule, LinearRegression, report
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.callbacks import CommMonitor, PhaseTimer
from lit_ddp.derive import trace, trace_memory
from lit_ddp.formatting import oom_line
from lit_ddp.measure import memory
from lit_ddp.present.comm import comm_table
from lit_ddp.present.phases import phase_table
from lit_ddp.records import phases as step_phases
from lit_ddp.records import schema as record
from lit_ddp.run.strategy import LitDDPStrategy
from tests.recorders import RecordDDPBuckets
from tests.runner import ROOT, run_fit
from tests.trainers import fast_trainer

DIM, HIDDEN, BATCH = 64, 4096, 16  # per rank
ACTIVATION = BATCH * HIDDEN * 4  # one float32 [BATCH, HIDDEN] activation: 256 KiB
STEPS = 5  # steps 2-4 profiled; 3 and 4 give memory on CPU


class KnownActivations(LightningModule):
    """``down(relu(up(x)))``: forward holds two [BATCH, HIDDEN] activations at once (up's output, then relu's),
    and keeps relu's for backward; everything else it allocates is [BATCH, DIM], 256 times smaller."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def memory_run(tmp_path, view: bool):
    log_dir = tmp_path / "run" / "version_0"
    trainer = fast_trainer(tmp_path, max_steps=STEPS, gradient_as_bucket_view=view, bucket_cap_mb=1,
                           callbacks=[PhaseTimer(kernel_steps=3, print_steps=0), CommMonitor(),
                                      RecordDDPBuckets(tmp_path / "ddp.json")],
                           logger=CSVLogger(tmp_path, name="run", version=0))  # fmt: skip
    trainer.fit(KnownActivations(), FixedBatchDataModule(dim=DIM, batch_size=BATCH))
    phases, comm = record.load_run(log_dir)
    return SimpleNamespace(phases=phases, comm=comm, ddp=json.loads((tmp_path / "ddp.json").read_text()), dir=log_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 2-rank run without and with ``gradient_as_bucket_view``."""
    return {view: memory_run(tmp_path_factory.mktemp(f"view_{view}"), view) for view in (False, True)}


@pytest.mark.timeout(240)
def test_ddp_memory_is_ddps_own_layout_exactly(runs):
    model = KnownActivations()
    params = [p.numel() * 4 for p in model.parameters()]
    for view, run in runs.items():
        held = run.comm.ddp_memory
        assert held.buckets == run.ddp["rebuilt_bucket_sizes"] == run.comm.layout  # DDP's own, after its rebuild
        assert len(held.buckets) > 1  # bucket_cap_mb=1 splits the 8 MiB of gradients
        assert sum(held.buckets) == held.gradients == held.parameters == sum(params)
        assert held.gradient_as_bucket_view is view and held.bucket_cap == 2**20
        # Adam: exp_avg and exp_avg_sq like each parameter, and a float32 step count per parameter.
        assert held.optimizer_state == 2 * sum(params) + 4 * len(params)
        assert held.own_gradients == (0 if view else sum(params))
        assert held.held == held.parameters + held.own_gradients + sum(held.buckets) + held.optimizer_state


@pytest.mark.timeout(240)
def test_gradient_as_bucket_view_gives_back_the_bucket_bytes(runs, capsys):
    separate, view = runs[False], runs[True]
    layout = sum(separate.comm.ddp_memory.buckets)
    saved = separate.phases.ranks[0].memory_summaries["peak.step"].max - view.phases.ranks[0].memory_summaries[
        "peak.step"].max  # fmt: skip
    with capsys.disabled():
        print(f"\ngradient_as_bucket_view: the layout's buckets {layout:,} bytes; the CPU profiler's step peak "
              f"{saved:,} bytes lower")  # fmt: skip
    assert abs(saved - layout) <= 0.05 * layout
    for rank in range(2):  # within the step both runs allocate the same: the saving is what the step holds
        for run in runs.values():
            assert run.phases.memory_source == "cpu_profiler"
            assert [m.step for m in run.phases.ranks[rank].memory] == [3, 4]
        above = [r.phases.ranks[rank].memory[-1].peak["step"] - r.phases.ranks[rank].memory[-1].start
                 for r in (separate, view)]  # fmt: skip
        assert abs(above[0] - above[1]) <= 0.05 * layout
    # What the tables say: the saving, as the layout's bytes.
    assert f"gradient_as_bucket_view true gives back {layout:,} bytes" in comm_table(
        analyze(separate.phases, separate.comm)
    )
    assert f"the gradients are the buckets, saving {layout:,} bytes" in comm_table(analyze(view.phases, view.comm))


@pytest.mark.timeout(240)
def test_forward_peak_holds_the_known_activations(runs):
    # Bound: the two [BATCH, HIDDEN] activations, plus what else forward allocates (a few [BATCH, DIM] tensors,
    # Lightning's scalars): under 64 KiB here.
    for run in runs.values():
        for rank in run.phases.ranks:
            for m in rank.memory:
                forward = m.peak["forward"] - m.start
                assert 2 * ACTIVATION <= forward <= 2 * ACTIVATION + 64 * 1024, (m.step, forward)
                kept = m.retained["forward"] - m.start  # relu's output, saved for backward
                assert ACTIVATION <= kept <= ACTIVATION + 64 * 1024, (m.step, kept)
                assert m.peak["step"] == max(m.peak[p] for p in step_phases.names())


@pytest.mark.timeout(240)
def test_memory_reaches_the_table_every_logger_and_the_report(runs, capsys):
    run = runs[False]
    table = phase_table(analyze(run.phases, run.comm))
    assert re.search(r"phase .* peak memory +retained\n", table)
    assert "Memory (rank " in table and "profile_memory=True" in table
    header = (run.dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {f"memory/{p}_peak_bytes" for p in step_phases.with_step()} <= set(header)
    # The end of fit's row holds the phase table's peak: the highest rank's median step peak.
    with open(run.dir / "metrics.csv", newline="") as f:
        (end,) = [row for row in csv.DictReader(f) if row.get("fit/peak_memory_bytes")]
    memory = analyze(run.phases, run.comm).memory
    assert float(end["fit/peak_memory_bytes"]) == memory.peak["step"].median > 0
    assert float(end["fit/peak_memory_rank"]) == memory.rank
    assert report.main([str(run.dir), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "peak memory" in out and "Memory per rank (exact, from the live objects)" in out


def test_trace_memory_per_phase_from_allocator_events(tmp_path):
    """A hand-made trace: a step of forward (+100, +50, -50), other (-10) and backward (+30, -100)."""

    def rng(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}

    def mem(ts, nbytes):
        return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": ts,
                "args": {"Bytes": nbytes, "Total Allocated": 0, "Device Type": 0}}  # fmt: skip

    events = [rng("lit_ddp.step#3", 0, 100), rng("lit_ddp.other", 0, 10), rng("lit_ddp.forward", 10, 30),
              rng("lit_ddp.other", 40, 10), rng("lit_ddp.backward", 50, 50), mem(-5, 7), mem(12, 100), mem(15, 50),
              mem(20, -50), mem(45, -10), mem(60, 30), mem(70, -100), mem(71, 1 << 20)]  # fmt: skip
    events[-1]["args"]["Device Type"] = 1  # a CUDA event: not the CPU's
    path = tmp_path / "rank0.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0}}).encode()))
    (step,) = trace_memory.step_memory(trace.load(path))
    assert step.step == 3
    assert step.peak == {"step": 150, "other": 100, "forward": 150, "backward": 120}
    assert step.retained == {"step": 20, "other": 90, "forward": 100, "backward": 20}
    rows = memory.cpu_step_memory([path], rank=0, anchors={3: 1000})
    assert [(r.step, r.start, r.peak["forward"], r.retained["step"]) for r in rows] == [(3, 1000, 1150, 1020)]
    assert memory.cpu_step_memory([path], rank=1, anchors={3: 1000}) == []


class FakeAllocator:
    """``torch.cuda``'s allocator statistics, driven by hand."""

    def __init__(self, monkeypatch):
        self.now, self.peak, self.resets = 0, 0, 0
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.now)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "memory_stats", self.stats)
        self.reads = 0

    def stats(self, device=None):
        self.reads += 1
        return {"allocated_bytes.all.peak": self.peak, "allocated_bytes.all.current": self.now}

    def reset(self, device=None):
        self.peak, self.resets = self.now, self.resets + 1

    def hold(self, nbytes):
        self.now += nbytes
        self.peak = max(self.peak, self.now)


def test_allocator_marks_split_the_peak_at_each_boundary(monkeypatch):
    alloc = FakeAllocator(monkeypatch)
    alloc.hold(1000)  # what training holds before the step
    marks = memory.AllocatorMarks(torch.device("cuda", 0))
    marks.mark("start")
    marks.drop()  # no step before this one
    marks.mark("forward_start")
    alloc.hold(300)  # activations
    alloc.hold(200)
    alloc.hold(-200)
    marks.mark("forward_end")
    marks.mark("backward_start")
    alloc.hold(400)  # gradients
    alloc.hold(-250)  # activations freed
    marks.mark("backward_end")
    marks.mark("update_start")
    alloc.hold(600)
    alloc.hold(-600)
    marks.mark("update_end")
    marks.mark("data_start")
    marks.mark("start")
    step = marks.end_step(7)
    assert step.start == 1000
    assert step.peak == {"step": 2050, "other": 1450, "forward": 1500, "backward": 1700, "update": 2050, "data": 1450}
    assert step.retained == {"step": 1450, "other": 1450, "forward": 1300, "backward": 1450, "update": 1450,
                             "data": 1450}  # fmt: skip
    assert alloc.resets == 10  # the constructor's and one per boundary: each interval's own peak
    assert alloc.reads == 10  # one memory_stats per boundary (and the constructor's), not one per figure
    assert marks.end_step(8).start == 1450  # the next step starts where this one ended


def test_allocator_marks_leave_the_users_peak_alone_after_the_measured_steps(monkeypatch):
    """Only the first ``steps`` steps are measured; after them nothing resets the allocator's peak, so the user's
    ``max_memory_allocated()`` (and DeviceStatsMonitor) after fit holds every later step's peak."""
    alloc = FakeAllocator(monkeypatch)
    marks = memory.AllocatorMarks(torch.device("cuda", 0), steps=2)
    for step in range(5):
        marks.mark("forward_start")
        alloc.hold(100 * (step + 1))  # each step's activations, a larger one each step
        alloc.hold(-100 * (step + 1))
        marks.mark("forward_end")
        row = marks.end_step(step)
        assert (row is not None) == (step < 2), (step, row)
    assert row is None and alloc.resets == 1 + 2 * 2  # the constructor's, and two boundaries in each of 2 steps
    assert torch.cuda.max_memory_allocated() == 500  # step 4's peak: the user's statistics are theirs again
    reads = alloc.reads
    marks.mark("forward_start")
    assert alloc.reads == reads  # and nothing reads the allocator either


class OutOfMemoryAtStep2(LinearRegression):
    def forward(self, x):
        if self.trainer.global_step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a stand-in on CPU)")
        return super().forward(x)


@pytest.mark.timeout(120)
def test_out_of_memory_names_step_phase_and_holders(tmp_path, capfd):
    """One rank in this process, under LitDDPStrategy (DDP and its buckets, no spawn)."""
    trainer = Trainer(accelerator="cpu", devices=1, strategy=LitDDPStrategy(start_method="popen", timeout_s=30),
                      max_steps=5, callbacks=[PhaseTimer(print_steps=0)], logger=CSVLogger(tmp_path, name="run"),
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(OutOfMemoryAtStep2(dim=256), FixedBatchDataModule(dim=256, batch_size=8))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "ran out of memory" in line]
    assert len(lines) == 1, err  # once, though both the strategy and on_exception saw it
    params = 4 * (256 * 256 + 256)
    path = tmp_path / "run" / "version_0" / "oom_rank0.json"
    assert lines[0] == (
        f"lit-ddp: rank 0 ran out of memory in step 2, forward (CUDA out of memory. Tried to allocate 2.00 GiB (a "
        f"stand-in on CPU)); held then: optimizer state 526.3 kB, parameters 263.2 kB, gradients 263.2 kB, DDP's "
        f"buckets 263.2 kB (the rest is not measured on CPU); record: {path}"
    )
    (oom,) = record.load_oom(path.parent)
    assert (oom.rank, oom.step, oom.phase, oom.held.parameters, oom.held.buckets) == (0, 2, "forward", params, [params])
    assert oom_line(oom, str(path)) == lines[0].removeprefix("lit-ddp: ")
    assert report.main([str(path.parent), "--no-plot"]) == 0
    assert lines[0].removeprefix("lit-ddp: ") in capfd.readouterr().out.splitlines()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(240)
def test_cuda_allocator_memory_per_phase_and_the_bucket_view(tmp_path):
    peaks = {}
    for view in (False, True):
        log_dir = tmp_path / str(view) / "run" / "version_0"
        trainer = Trainer(accelerator="gpu", devices=1, max_steps=STEPS,
                          strategy=LitDDPStrategy(gradient_as_bucket_view=view, bucket_cap_mb=1),
                          callbacks=[PhaseTimer(print_steps=0), CommMonitor()],
                          logger=CSVLogger(tmp_path / str(view), name="run", version=0), enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        trainer.fit(KnownActivations(), FixedBatchDataModule(dim=DIM, batch_size=BATCH))
        # One rank in this process: its process group and rendezvous port must not carry into the second fit.
        dist.destroy_process_group()
        os.environ.pop("MASTER_PORT", None)
        phases, comm = record.load_run(log_dir)
        assert phases.memory_source == "cuda_allocator"
        steady = [m for m in phases.ranks[0].memory if m.step >= 1]
        assert len(steady) == STEPS - 1
        for m in steady:  # the caching allocator rounds each block up to 512 bytes: within that
            forward = m.peak["forward"] - m.start
            assert 2 * ACTIVATION <= forward <= 2 * ACTIVATION + 64 * 1024, (m.step, forward)
        peaks[view] = (phases.ranks[0].memory_summaries["peak.step"].max, sum(comm.ddp_memory.buckets))
    saved, layout = peaks[False][0] - peaks[True][0], peaks[False][1]
    print(f"gradient_as_bucket_view: the layout's buckets {layout:,} bytes; the CUDA allocator's step peak "
          f"{saved:,} bytes lower")  # fmt: skip
    assert abs(saved - layout) <= 0.05 * layout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_forked_rank_out_of_memory_says_so_before_the_job_ends(tmp_path):
    """Under the CLI's ddp_fork ranks, where no callback's on_exception runs: LitDDPStrategy's catch."""
    result = run_fit("--config", str(ROOT / "configs" / "mini_train_profile.yaml"), "--devices", "2",
                     "--model.dim", "256", "--trainer.max_steps", "6",
                     "--trainer.callbacks+=tests.faults.OutOfMemoryOnRank", "--trainer.callbacks.step=5", cwd=tmp_path,
                     timeout=150)  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    path = tmp_path / "runs" / "mini_train_profile" / "version_0" / "oom_rank1.json"
    (line,) = [line for line in result.stderr.splitlines() if "ran out of memory" in line]
    assert re.fullmatch(r"lit-ddp: rank 1 ran out of memory in step 5, forward \(CUDA out of memory \(injected on "
                        r"rank 1 at step 5\)\); memory peaked at [\d.]+ [kM]B in step [34], update; held then: .*"
                        r"DDP's buckets 263.2 kB \(the rest is not measured on CPU\); record: " + re.escape(
                            str(path.relative_to(tmp_path))), line), line  # fmt: skip
    assert path.is_file() and not (path.parent / "oom_rank0.json").exists()
    assert result.stderr.index(line) < result.stderr.index("rank 1 exited with code 1: OutOfMemoryError")


@pytest.mark.timeout(30)
def test_frozen_parameters_hold_no_gradient_and_no_optimizer_state():
    """A model whose first layer is frozen (fine-tuning): its parameters are held, but gradients, what a step holds
    and the out-of-memory holders count the trainable layer's gradients only."""
    from lit_ddp.formatting import holders

    net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # 576 + 272 bytes of float32 parameters
    net[0].requires_grad_(False)
    optimizer = torch.optim.Adam(p for p in net.parameters() if p.requires_grad)
    before = memory.ddp_memory(net, [optimizer], allocated_only=True)
    assert (before.parameters, before.gradients, before.optimizer_state) == (848, 0, 0)  # no gradient yet
    net(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    for allocated_only in (False, True):  # the trainable layer's gradients, allocated or counted
        held = memory.ddp_memory(net, [optimizer], allocated_only=allocated_only)
        assert (held.parameters, held.gradients) == (848, 272), allocated_only
    # Adam keeps exp_avg and exp_avg_sq per trainable parameter, and a 4-byte step count each.
    assert held.optimizer_state == 2 * 272 + 2 * 4 and held.held == 848 + 272 + 552
    assert holders(held, None) == [("parameters", 848), ("optimizer state", 552), ("gradients", 272)]


def memory_steps(scale: int) -> list[record.StepMemory]:
    """Steps 2-4 starting from 1 kB x ``scale``; each phase's peak and what it retained, the backward's peak a byte
    higher each step."""
    return [record.StepMemory(s, 1000 * scale, {"forward": 3000 * scale + s, "backward": 5000 * scale + s,
                                                 "update": 2500 * scale, "step": 5000 * scale + s},
                              {"forward": 2000 * scale, "backward": 1500 * scale, "update": 1200 * scale,
                               "step": 1200 * scale}) for s in (2, 3, 4)]  # fmt: skip


@pytest.mark.timeout(10)
def test_the_memory_columns_are_the_highest_ranks_medians_and_the_line_says_whose_and_over_what():
    from lit_ddp.derive.memory import memory_of, memory_summary
    from lit_ddp.present import memory as text
    from tests.records import phase_record

    phases = phase_record([[(1.0, 2.0, 0.5, 0.1)] * 5] * 2)
    assert memory_of(phases) is None and memory_of(None) is None
    phases.ranks[0].memory, phases.ranks[1].memory = memory_steps(1), memory_steps(2)
    phases.memory_source = "cpu_profiler"
    memory = memory_of(phases)
    assert memory.rank == 1
    assert text.memory_cells(memory) == [("6.00 kB", "4.00 kB"), ("10.0 kB", "3.00 kB"), ("5.00 kB", "2.40 kB"),
                                         ("-", "-"), ("-", "-"), ("10.0 kB", "2.40 kB")]  # PHASES' order # fmt: skip
    said = ("peak = the most held at once in the phase, retained = held at its end; the step peaked at 10.0 kB "
            "median, 10.0 kB max, starting from 2.00 kB")  # fmt: skip
    assert text.memory_line(memory) == (
        "Memory (rank 1, the highest; steps 2-4; the CPU allocator's events in the profiled steps (torch.profiler, "
        "profile_memory=True), on top of what parameters, gradients, DDP's buckets and optimizer state held at each "
        f"step's start): {said}")  # fmt: skip
    phases.memory_source = "cuda_allocator"
    assert text.memory_line(memory_of(phases)) == ("Memory (rank 1, the highest; 3 step(s); the CUDA caching "
                                                   "allocator: bytes of live tensors, its peak reset at each phase "
                                                   f"boundary): {said}")  # fmt: skip
    phases.ranks[1].memory, phases.memory_source = phases.ranks[1].memory[:1], "elsewhere"
    assert text.memory_line(memory_of(phases)).startswith("Memory (rank 1, the highest; step 2; elsewhere): peak = ")
    # A summary over every step, where the rank kept one, is taken over the steps it kept.
    phases.ranks[1].memory_summaries = {"peak.step": record.Sketch.of([1e9]), "start": record.Sketch.of([])}
    assert memory_summary(phases, 1, "peak.step").median == 1e9
    assert memory_summary(phases, 1, "start").median == 2000


@pytest.mark.timeout(10)
def test_ddps_own_memory_says_what_the_bucket_view_and_compression_change():
    from lit_ddp.formatting import holders
    from lit_ddp.present.memory import ddp_memory_lines

    view = record.DDPMemory(6000, 3000, [1000, 2000, *[500] * 7], True, 12000, 0, "bf16")
    assert ddp_memory_lines(view).splitlines() == [
        "Memory per rank (exact, from the live objects): parameters 6,000 bytes; gradients 3,000 bytes (views into "
        "the buckets); DDP's 9 gradient bucket(s) 6,500 bytes [1,000, 2,000, 500, 500, 500, 500, 500, 500, ...]; "
        "optimizer state 12,000 bytes; held 24,500 bytes (24.5 kB) before activations.",
        "gradient_as_bucket_view is on: the gradients are the buckets, saving 6,500 bytes.",
        "bucket_cap_mb (its cap now) changes how the 6,500 bytes split (largest bucket 2,000), not their sum.",
        "bf16 compression halves the bytes on the wire, not in memory: the buckets stay in the parameters' dtype and "
        "each all-reduce casts a copy (1,000 bytes for the largest bucket) for its time on the wire.",
    ]  # fmt: skip
    assert ddp_memory_lines(record.DDPMemory(6000, 3000, [], False, 0, 0)) == (
        "Memory per rank (exact, from the live objects): parameters 6,000 bytes; gradients 3,000 bytes (a tensor per "
        "parameter); DDP's 0 gradient bucket(s) 0 bytes []; optimizer state 0 bytes; held 9,000 bytes (9.00 kB) "
        "before activations.")  # fmt: skip
    # The bucket view's gradients hold nothing of their own; the rest is never below zero.
    assert holders(record.DDPMemory(6000, 3000, [3000], True, 0, 0), 5000) == [("parameters", 6000),
                                                                                ("DDP's buckets", 3000)]  # fmt: skip


@pytest.mark.timeout(10)
def test_the_out_of_memory_line_names_the_step_the_peak_and_the_holders_largest_first():
    held = record.DDPMemory(6000, 3000, [3000], False, 12000, 1 << 20)
    oom = record.OutOfMemory(record.RunMeta(2, "cuda", "H100", "nccl", "cuda_event", "32-true", "2", "2"), 1, 7,
                             "backward", "CUDA out of memory", held, allocated=40000, peak=39000, peak_step=6,
                             peak_phase="forward", snapshot="snap.pickle")  # fmt: skip
    assert oom_line(oom, "runs/x/oom_rank1.json") == (
        "rank 1 ran out of memory in step 7, backward (CUDA out of memory); memory peaked at 39.0 kB in step 6, "
        "forward; held then: the rest (activations, workspace) 16.0 kB, optimizer state 12.0 kB, parameters 6.00 kB, "
        "gradients 3.00 kB, DDP's buckets 3.00 kB; record: runs/x/oom_rank1.json; snapshot: snap.pickle")  # fmt: skip
    cpu = record.OutOfMemory(oom.meta, 0, 3, "forward", "boom", record.DDPMemory(0, 0, [], False, 0, 0))
    assert oom_line(cpu) == ("rank 0 ran out of memory in step 3, forward (boom); held then: nothing the tool sees "
                             "(the rest is not measured on CPU)")  # fmt: skip


@pytest.mark.timeout(10)
def test_the_highest_rank_can_be_rank_0_its_summaries_come_first_and_without_kept_steps_the_line_says_no_step():
    from lit_ddp.derive.memory import memory_of
    from lit_ddp.present import memory as text
    from lit_ddp.present.memory import ddp_memory_lines
    from tests.records import phase_record

    phases = phase_record([[(1.0, 2.0, 0.5, 0.1)] * 5] * 3)
    for rank, scale in zip(phases.ranks, (3, 1, 2), strict=True):
        rank.memory = memory_steps(scale)
    phases.memory_source = "cpu_profiler"
    assert memory_of(phases).rank == 0
    # A summary over every step the rank ran, where it kept one, outranks its kept steps (3,000 x 3 + s retained).
    phases.ranks[0].memory_summaries = {"peak.forward": record.Sketch.of([7000.0]),
                                        "retained.forward": record.Sketch.of([4000.0])}  # fmt: skip
    assert text.memory_cells(memory_of(phases))[:2] == [("7.00 kB", "4.00 kB"), ("15.0 kB", "4.50 kB")]
    # Its summaries alone, no kept step with memory figures: over no step.
    phases.ranks[0].memory = []
    phases.ranks[0].memory_summaries = {"peak.step": record.Sketch.of([20000.0]), "start": record.Sketch.of([3000.0])}
    line = text.memory_line(memory_of(phases))
    assert line.startswith("Memory (rank 0, the highest; no step; the CPU allocator's events ")
    assert line.endswith("the step peaked at 20.0 kB median, 20.0 kB max, starting from 3.00 kB")
    # Eight buckets are listed in full; a ninth would be "...".
    eight = ddp_memory_lines(record.DDPMemory(8000, 8000, [1000] * 8, False, 0, 0)).splitlines()[0]
    assert f"DDP's 8 gradient bucket(s) 8,000 bytes [{', '.join(['1,000'] * 8)}];" in eight


@pytest.mark.timeout(10)
def test_trace_memory_takes_steps_by_start_a_phase_from_the_steps_start_and_every_range_of_a_phase():
    """A Trace built by hand, its ranges in no order (``trace.load`` sorts them; ``step_memory`` does not rely on
    it): step 9 (0-100 us) accumulates two micro-batches, its first forward starting with the step, and frees all
    by its update (which allocates nothing); step 10's forward starts where step 9 ends, and is step 10's alone."""
    R = trace.Range
    ranges = (R("lit_ddp.step#10", 100.0, 200.0), R("lit_ddp.step#9", 0.0, 100.0),
              R("lit_ddp.backward", 150.0, 200.0),
              R("lit_ddp.forward", 60.0, 70.0), R("lit_ddp.update", 90.0, 100.0), R("lit_ddp.forward", 0.0, 30.0),
              R("lit_ddp.backward", 30.0, 60.0), R("lit_ddp.backward", 70.0, 90.0),
              R("lit_ddp.forward", 100.0, 150.0))  # fmt: skip
    allocations = [(10.0, 100), (40.0, -60), (65.0, 20), (80.0, -60), (120.0, 50), (160.0, -50)]
    events = tuple(trace.MemoryEvent(t, n, trace.CPU_DEVICE) for t, n in allocations)
    nine, ten = trace_memory.step_memory(trace.Trace(ROOT / "hand-made", 0, 1, (), ranges, events))
    # Forward: 100 in the first micro-batch, 60 in the second; what the last forward left held: 60.
    assert nine == trace_memory.StepMemoryTrace(9, {"step": 100, "forward": 100, "backward": 100, "update": 0},
                                                {"step": 0, "forward": 60, "backward": 0, "update": 0})  # fmt: skip
    assert ten == trace_memory.StepMemoryTrace(10, {"step": 50, "forward": 50, "backward": 50},
                                               {"step": 0, "forward": 50, "backward": 0})  # fmt: skip
