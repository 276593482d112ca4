"""Forward, backward, update, data and other time of every step on every rank: the notes' ``mini_train_profile.py``.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

A thin callback, as Lightning's ``ThroughputMonitor`` is over ``Throughput``: it holds the options, and each fit's
state is one ``lit_ddp.measure.fit_phases.FitPhases`` made fresh in ``on_train_start`` (a resumed fit warms up and
profiles its own steps). Marks each step at Lightning's hooks, a forward pre-hook on the wrapped model and every
optimizer's step post-hook (``lit_ddp.measure.step_marks`` turns the marks into phases), with CUDA events on GPUs and
``perf_counter`` on CPU (``lit_ddp.measure.clock``); on GPUs a few steps are profiled for GPU-busy time
(``lit_ddp.measure.profiling``); the fit's first step's FLOPs are counted as Lightning runs it
(``lit_ddp.measure.roofline.StepFlopCounter``: the user's code runs no extra time). Each rank keeps a bounded
record, given to rank 0 once at the end of training: ``phases.json`` (a ``PhaseRecord``) and the phase table,
roofline and verdict (``lit_ddp.present.phases``). Where each phase starts
and ends: docs/output.md; a step: docs/architecture.md. Memory per phase (``lit_ddp.measure.memory``), and
where a rank ran out of it (``on_out_of_memory``): docs/memory.md.
"""

import socket
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse.typing import NonNegativeInt, PositiveFloat
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_ddp import _torch
from lit_ddp.callbacks import end_of_fit
from lit_ddp.callbacks.collective_recorder import CollectiveRecorder
from lit_ddp.callbacks.shared import (
    device_name,
    exit_cleanly,
    gather_to_zero,
    grad_scaler,
    log_metrics,
    meta,
    say,
)
from lit_ddp.callbacks.step_sync import StepSync
from lit_ddp.errors import Ending
from lit_ddp.formatting import oom_line
from lit_ddp.measure import memory, roofline
from lit_ddp.measure.clock import CudaClock, clock_for
from lit_ddp.measure.fit_phases import FIRST_PROFILED_STEP, FitPhases
from lit_ddp.measure.profiling import LightningProfilerTraces, TraceRecorder
from lit_ddp.records import phases as phase_table
from lit_ddp.records.phases import StepPhases
from lit_ddp.records.schema import NamedWait, PhaseRecord, Roofline, save
from lit_ddp.run import watchdog
from lit_ddp.run.lean import LeanCallback

__all__ = ["FIRST_PROFILED_STEP", "PhaseTimer"]


class PhaseTimer(LeanCallback):
    """Times forward, backward and update of each step on each rank, correctly on GPUs.

    Args:
        print_steps: Rank 0 prints the notes' per-step block (``Step 0`` / ``forward : ...``) for the fit's first
            ``print_steps`` steps; 0 (the default): the tables at the end say it all (the notes' profile config
            asks for 3).
        peak_tflops: Peak matmul TFLOP/s of one device, for the roofline's fraction of peak. By default the
            datasheet figure of a known GPU for the parameters' dtype (``lit_ddp.measure.roofline.GPU_PEAKS``).
        peak_gbps: Peak memory bandwidth (GB/s) of one device, for the update's fraction of peak; by default
            that of a known GPU.
        filename: Name of the JSON written in the run's log dir.
        kernel_steps: Profile this many steps (from the fit's third: step 2, or 2 after the resume point) with
            ``torch.profiler``, keep each rank's
            trace in ``<log_dir>/traces`` and read from it the GPU's busy time inside each phase
            (``lit_ddp.measure.profiling``). ``None``: 3 on CUDA, 0 elsewhere; on CPU a number profiles the CPU
            only (traces, no GPU-busy column). With Lightning's ``PyTorchProfiler`` on, PhaseTimer reads its
            traces instead and starts no profiler. On CPU the profiled steps after the first also give memory per
            phase (the CPU allocator's events; ``configs/mini_train_profile.yaml`` profiles 3).
        memory_snapshot: On CUDA, record the allocator's history (``torch.cuda.memory._record_memory_history``)
            and, if a rank runs out of memory, dump it to ``<log_dir>/memory_snapshot_rank<r>.pickle`` (open it in
            https://pytorch.org/memory_viz). Off by default: recording slows every allocation.
        count_flops: Count the FLOPs of the fit's first step (its warm-up) under torch's ``FlopCounterMode``, while
            Lightning runs it, for the roofline. False: no FLOP count (a model whose ops the counter cannot run).
    """

    def __init__(
        self,
        print_steps: NonNegativeInt = 0,
        peak_tflops: Optional[PositiveFloat] = None,
        peak_gbps: Optional[PositiveFloat] = None,
        filename: str = "phases.json",
        kernel_steps: Optional[NonNegativeInt] = None,
        memory_snapshot: bool = False,
        count_flops: bool = True,
    ) -> None:
        if kernel_steps is not None and kernel_steps < 0:
            raise ValueError(f"`PhaseTimer(kernel_steps={kernel_steps!r})` must be >= 0")
        if print_steps < 0:
            raise ValueError(f"`PhaseTimer(print_steps={print_steps!r})` must be >= 0")
        for name, value in (("peak_tflops", peak_tflops), ("peak_gbps", peak_gbps)):
            if value is not None and not value > 0:
                raise ValueError(f"`PhaseTimer({name}={value!r})` must be > 0")
        self.print_steps = print_steps
        self.peak_tflops = peak_tflops
        self.peak_gbps = peak_gbps
        self.filename = filename
        self.kernel_steps = kernel_steps
        self.memory_snapshot = memory_snapshot
        self.count_flops = count_flops
        self._fit: Optional[FitPhases] = None  # the running (or last) fit's state, made in on_train_start
        self._handles: list[Any] = []
        self._run_dir: Optional[str] = None  # trainer.log_dir, asked once while every rank is there
        self.record: Optional[PhaseRecord] = None  # rank 0's, once training ended
        self._metrics = _metrics()
        self.log_dir: Optional[str] = None

    @property
    def profiled_steps(self) -> range:
        """The global steps the running (or last) fit profiles (``ProfilesSteps``): from its own first step on."""
        return self._fit.profiled_steps if self._fit is not None else range(0)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        exit_cleanly(trainer)
        end_of_fit.owner(trainer).expect(self)
        self._metrics = _metrics()
        clock = clock_for(trainer.strategy.root_device)
        if isinstance(clock, CudaClock):
            clock.anchor()  # events to host time, for each step's start: one synchronize, before the first step
        self.record = None  # this fit's, once it ends (rank 0's)
        self._run_dir = trainer.log_dir  # a broadcast, so here: a rank that runs out of memory alone needs it
        if self.memory_snapshot:
            if clock.name == "cuda_event":
                _torch.record_memory_history(True)
            else:
                rank_zero_warn("PhaseTimer(memory_snapshot=True) needs CUDA: no memory snapshot on this device")
        kernel_steps = self.kernel_steps if self.kernel_steps is not None else (3 if clock.name == "cuda_event" else 0)
        recorder: Optional[TraceRecorder | LightningProfilerTraces] = None
        if isinstance(trainer.profiler, PyTorchProfiler):
            # One torch profiler runs at a time (Lightning's disables any other as it starts): read its traces.
            recorder = LightningProfilerTraces(trainer.profiler.dirpath, trainer.global_rank)
            recorder.start()
        elif kernel_steps:  # trainer.log_dir is a broadcast: every rank is here
            path = Path(trainer.log_dir) / "traces" / f"rank{trainer.global_rank}.pt.trace.json.gz"
            recorder = TraceRecorder(trainer.strategy.root_device, path, trainer.global_rank)
        self._fit = FitPhases(trainer.global_step, clock, memory.marks_for(trainer.strategy.root_device), recorder,
                              kernel_steps, (trainer.strategy.model, list(trainer.optimizers)), self.count_flops,
                              rank_zero_info)  # fmt: skip
        # Lightning has no hook where the forward starts (after its own batch handling) nor where an optimizer's
        # step() returns: a forward pre-hook on the model Lightning calls, a step post-hook on every optimizer.
        self._handles = [
            trainer.strategy.model.register_forward_pre_hook(self._on_forward_start),
            *(opt.register_step_post_hook(self._on_optimizer_step_end) for opt in trainer.optimizers),
        ]
        self._resolve_every = max(1, trainer.log_every_n_steps)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        fit = self._fit
        fit.batch_start(trainer, batch)
        # The window's work (marks to phases, summaries, the loggers' rows) in one go every log_every_n_steps steps
        # (Lightning's cadence for logged step metrics), not a piece of it in every step; while the first steps'
        # blocks are printed, every step.
        if fit.pending >= self._resolve_every or fit.step - fit.first_step <= self.print_steps:
            self._resolve(trainer, block=False)

    def _on_forward_start(self, module, args) -> None:
        self._fit.mark_once("forward_start")

    @override
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._fit.mark_once("forward_end")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._fit.backward_start()

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit.backward_end()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._fit.update_start()

    def _on_optimizer_step_end(self, optimizer, args, kwargs) -> None:
        self._fit.update_end(optimizer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self._fit.batch_end(trainer, scaled=grad_scaler(trainer) is not None)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and self._fit is not None:
            self._fit.validation_start()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._fit is not None:
            self._fit.validation_end()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fit = self._fit
        fit.end()
        self._remove_hooks()
        self._resolve(trainer, block=True)
        self.log_dir = trainer.log_dir  # a broadcast: every rank asks
        mine = fit.rank_phases(trainer.global_rank)
        mine.node, mine.host, mine.device = trainer.node_rank, socket.gethostname(), str(trainer.strategy.root_device)
        mine.collectives = CollectiveRecorder.calls_of(trainer, {row.step for row in mine.rows})
        mine.waits = _waits_said()
        ranks = gather_to_zero(trainer, mine)
        if ranks is not None and ranks[0].rows:
            source = fit.memory.source or (memory.CPU_SOURCE if ranks[0].memory else None)
            self.record = PhaseRecord(meta(trainer, fit.clock.name), ranks, list(fit.profiled_steps),
                                      self._roofline(trainer, pl_module), skipped_steps=fit.skipped,
                                      skipped_count=fit.skipped_count, memory_source=source,
                                      first_step=fit.first_step, ended_by=_ended_by(trainer))  # fmt: skip

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A failed fit leaves no profiler running and no hook behind: the next fit in this process needs neither."""
        if isinstance(exception, torch.OutOfMemoryError):  # a rank in this process (ddp, torchrun, one device)
            self.on_out_of_memory(trainer, exception)
        if self._fit is not None:
            try:  # the window's finished steps to the loggers: a failed run's timings are the ones looked at
                self._resolve(trainer, block=False)
            except RuntimeError as error:  # a CUDA error is sticky: no event can be read after it
                rank_zero_warn(f"PhaseTimer: the last window's steps were not logged ({error})")
            self._fit.close()
        self._remove_hooks()

    def on_out_of_memory(self, trainer: Trainer, exception: BaseException) -> None:
        """On the rank that ran out of memory, before the job ends (the other ranks may wait in a collective): one
        line naming the step and phase, where memory peaked and what held it, and ``oom_rank<r>.json`` beside the
        run's record. ``LitDDPStrategy`` calls it where the error is raised (a ``ddp_spawn``/``ddp_fork`` rank
        reaches no ``on_exception``; ``lit_ddp.run.roles.ReportsOutOfMemory``), ``on_exception`` elsewhere; once per
        fit."""
        fit = self._fit
        if fit is None or fit.oom_reported:
            return
        fit.oom_reported = True
        run_dir, rank = Path(self._run_dir or "."), trainer.global_rank
        snapshot = None
        if self.memory_snapshot and fit.memory.source:
            snapshot = str(run_dir / f"memory_snapshot_rank{rank}.pickle")
            _torch.dump_memory_snapshot(snapshot)
        error = next(iter(str(exception).strip().splitlines()), type(exception).__name__)
        oom = fit.out_of_memory(meta(trainer, fit.clock.name), rank, error, snapshot)
        path = save(oom, run_dir / f"oom_rank{rank}.json")
        print(f"lit-ddp: {oom_line(oom, str(path))}", file=sys.stderr, flush=True)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.memory_snapshot and self._fit is not None and self._fit.memory.source:
            _torch.record_memory_history(False)

    def _resolve(self, trainer: Trainer, block: bool) -> None:
        """The steps whose marks have completed, to the loggers (and printed, the first ``print_steps``)."""
        fit = self._fit
        done = fit.resolve(block)
        for row in fit.new_memory:
            metrics = {f"memory/{p}_{kind}_bytes": float(getattr(row, kind)[p]) for kind in ("peak", "retained")
                       for p in phase_table.with_step() if p in getattr(row, kind)}  # fmt: skip
            log_metrics(trainer, metrics, step=row.step)
        fit.new_memory = []
        for step, phases in done:
            if step - fit.first_step < self.print_steps:
                say(trainer, format_step(step, phases))
            log_metrics(trainer, {metric: phases[p] for metric, p in self._metrics}, step=step)

    def _roofline(self, trainer: Trainer, pl_module: LightningModule) -> Roofline:
        fit = self._fit
        dtype = _compute_dtype(trainer, pl_module)
        peak = roofline.peak_for(device_name(trainer.strategy.root_device), dtype)
        flops = fit.flops or roofline.StepFlops(0, 0)
        # The count is the whole first step's, every micro-batch; so are its rows.
        micro = getattr(trainer, "accumulate_grad_batches", 1) if pl_module.automatic_optimization else 1
        return Roofline(
            rows_per_rank=fit.rows,
            forward_flop=flops.forward,
            backward_flop=flops.backward,
            update_bytes=fit.update_bytes or roofline.optimizer_update_bytes(trainer.optimizers[0]),
            peak_tflops=self.peak_tflops or (peak.tflops if peak else None),
            peak_gbps=self.peak_gbps or (peak.gbps if peak else None),
            peak_label="given" if self.peak_tflops or self.peak_gbps else (peak.label if peak else None),
            micro_batches=micro,
            compute_dtype=str(dtype).removeprefix("torch."),
            flop_source=f"FlopCounterMode, step {fit.flop_step}" if fit.flops is not None else None,
        )


def _compute_dtype(trainer: Trainer, pl_module: LightningModule) -> torch.dtype:
    """The dtype the matmuls run in: the Trainer's precision (``bf16-mixed``, ``16-true``, ...), else the
    parameters'."""
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    param = next((p for p in pl_module.parameters() if p.requires_grad), None)
    return param.dtype if param is not None else torch.float32


def _waits_said() -> list[NamedWait]:
    """What this rank's watchdog said during the fit (a wait named, then moved on), taken once for the record."""
    watch = watchdog.current()
    if watch is None:
        return []
    said = [NamedWait(step, at_s, line) for step, at_s, line in watch.said]
    watch.said.clear()
    return said


def _ended_by(trainer: Trainer) -> Optional[str]:
    """``"SIGTERM"`` where StepSync stopped the fit on one (every rank at the same step), else None."""
    return "SIGTERM" if StepSync.ending_of(trainer) == Ending.SIGTERM else None


def format_step(step: int, phases: StepPhases) -> str:
    """The notes' per-step format (``mini_train_profile.py``), times in ms."""
    return (f"Step {step}\n forward : {phases.forward:.2f} ms\n backward: {phases.backward:.2f} ms\n"
            f" update  : {phases.update:.2f} ms")  # fmt: skip


def _metrics() -> tuple[tuple[str, str], ...]:
    """(logged name, phase) of each per-step time, read from the phase table once a fit."""
    return tuple((f"time/{phase}_ms", phase) for phase in phase_table.with_step())
