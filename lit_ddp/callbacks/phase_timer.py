"""Forward, backward, update, data and other time of every step on every rank: the notes' ``mini_train_profile.py``.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

Marks each step at Lightning's hooks, a forward pre-hook on the wrapped model and the optimizer's step post-hook
(``lit_ddp.measure.step_marks`` turns the marks into phases), with CUDA events on GPUs and ``perf_counter`` on CPU
(``lit_ddp.measure.clock``); on GPUs a few steps are profiled for GPU-busy time (``lit_ddp.measure.profiling``).
Each rank keeps a bounded record, given to rank 0 once at the end of training: ``phases.json`` (a
``PhaseRecord``) and the phase table, roofline and verdict (``lit_ddp.analysis.phases``). Where each phase starts
and ends: docs/output.md; a step: docs/architecture.md. Memory per phase (``lit_ddp.measure.memory``), and
where a rank ran out of it (``on_out_of_memory``): docs/memory.md.
"""

import sys
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse.typing import NonNegativeInt, PositiveFloat
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_ddp import _torch
from lit_ddp.analysis.memory import oom_line
from lit_ddp.analysis.phases import format_step
from lit_ddp.callbacks.shared import (
    device_name,
    exit_cleanly,
    gather_to_zero,
    grad_scaler,
    log_metrics,
    meta,
    report_timers,
    say,
)
from lit_ddp.measure import memory, roofline
from lit_ddp.measure.clock import HostClock, clock_for
from lit_ddp.measure.profiling import LightningProfilerTraces, TraceRecorder, describe, read_busy
from lit_ddp.measure.step_marks import OptimizerSteps, StepMarks, close_micro_batch, phases_of
from lit_ddp.records.schema import (
    MAX_SKIPPED_KEPT,
    PHASES,
    OutOfMemory,
    PhaseRecord,
    RankPhases,
    Roofline,
    Sketch,
    StepMemory,
    StepPhases,
    StepRow,
    Window,
    is_steady,
    save,
)

FIRST_PROFILED_STEP = 2  # after the warm-up step and one more (allocator, DDP's bucket rebuild)
METRICS = tuple(f"time/{phase}_ms" for phase in PHASES)


class PhaseTimer(Callback):
    """Times forward, backward and update of each step on each rank, correctly on GPUs.

    Args:
        print_steps: Rank 0 prints the notes' per-step block (``Step 0`` / ``forward : ...``) for the first
            ``print_steps`` steps; 0 (the default): the tables at the end say it all (the notes' profile config
            asks for 3).
        peak_tflops: Peak matmul TFLOP/s of one device, for the roofline's fraction of peak. By default the
            datasheet figure of a known GPU for the parameters' dtype (``lit_ddp.measure.roofline.GPU_PEAKS``).
        peak_gbps: Peak memory bandwidth (GB/s) of one device, for the update's fraction of peak; by default
            that of a known GPU.
        filename: Name of the JSON written in the run's log dir.
        kernel_steps: Profile this many steady steps (from step 2) with ``torch.profiler``, keep each rank's
            trace in ``<log_dir>/traces`` and read from it the GPU's busy time inside each phase
            (``lit_ddp.measure.profiling``). ``None``: 3 on CUDA, 0 elsewhere; on CPU a number profiles the CPU
            only (traces, no GPU-busy column). With Lightning's ``PyTorchProfiler`` on, PhaseTimer reads its
            traces instead and starts no profiler. On CPU the profiled steps after the first also give memory per
            phase (the CPU allocator's events; ``configs/mini_train_profile.yaml`` profiles 3).
        memory_snapshot: On CUDA, record the allocator's history (``torch.cuda.memory._record_memory_history``)
            and, if a rank runs out of memory, dump it to ``<log_dir>/memory_snapshot_rank<r>.pickle`` (open it in
            https://pytorch.org/memory_viz). Off by default: recording slows every allocation.
    """

    def __init__(
        self,
        print_steps: NonNegativeInt = 0,
        peak_tflops: Optional[PositiveFloat] = None,
        peak_gbps: Optional[PositiveFloat] = None,
        filename: str = "phases.json",
        kernel_steps: Optional[NonNegativeInt] = None,
        memory_snapshot: bool = False,
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
        self._memory: Any = memory.NoMarks()  # CUDA: the allocator read at each boundary
        self._memory_window = Window()
        self._memory_summaries: dict[str, Sketch] = {}
        self._memory_new: list[StepMemory] = []  # rows not yet given to the loggers
        self._anchors: dict[int, int] = {}  # CPU: profiled step -> bytes held at its start
        self._training: tuple[Any, list] = (None, [])  # the (DDP-)wrapped model and the optimizers
        self._run_dir: Optional[str] = None  # trainer.log_dir, asked once while every rank is there
        self._oom_reported = False
        self._recorder: Optional[TraceRecorder | LightningProfilerTraces] = None
        self._busy: list[StepRow] = []  # per profiled step: GPU-busy ms of each phase
        self._clock: Any = HostClock()
        self._step = -1
        self._marks: dict[str, Any] = {}
        self._pending: list[StepMarks] = []  # steps whose marks are not resolved yet
        self._micro: list[dict[str, Any]] = []  # the running step's finished micro-batches (gradient accumulation)
        self._outside: list[tuple[str, Any, Any]] = []  # the running step's spans of no training step's work
        self._outside_start: Any = None
        self._outside_summaries: dict[str, Sketch] = {}
        self._steps, self._stepped = OptimizerSteps(), True  # the last batch's end made an optimizer step
        self._skipped: list[int] = []  # steps the grad scaler skipped (16-mixed: inf/NaN gradients)
        self._skipped_count = 0
        self._real_flops = roofline.RealStepFlops()  # manual optimization: counted in its real step 0
        self._update_bytes: Optional[int] = None
        self._window = Window()
        self._summaries: dict[str, Sketch] = {}
        self.profiled_steps = range(0)
        self.record: Optional[PhaseRecord] = None  # rank 0's, once training ended
        self.ended = False
        self.log_dir: Optional[str] = None
        self._flops: Optional[roofline.StepFlops] = None
        self._counted = False
        self._rows = 0
        self._handles: list[Any] = []

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        exit_cleanly(trainer)
        self._clock = clock_for(trainer.strategy.root_device)
        self._pending, self._marks, self._micro, self._outside, self._outside_start = [], {}, [], [], None
        self._outside_summaries, self._stepped = {}, True
        self._skipped, self._skipped_count, self._update_bytes = [], 0, None
        self.record, self.ended = None, False
        self._flops, self._counted = None, False
        self._busy, self._recorder = [], None
        self._memory = memory.marks_for(trainer.strategy.root_device)
        self._memory_summaries, self._memory_new, self._anchors, self._oom_reported = {}, [], {}, False
        self._training = (trainer.strategy.model, list(trainer.optimizers))
        self._run_dir = trainer.log_dir  # a broadcast, so here: a rank that runs out of memory alone needs it
        if self.memory_snapshot:
            if self._clock.name == "cuda_event":
                _torch.record_memory_history(True)
            else:
                rank_zero_warn("PhaseTimer(memory_snapshot=True) needs CUDA: no memory snapshot on this device")
        kernel_steps = (
            self.kernel_steps if self.kernel_steps is not None else (3 if self._clock.name == "cuda_event" else 0)
        )
        if isinstance(trainer.profiler, PyTorchProfiler):
            # One torch profiler runs at a time (Lightning's disables any other as it starts): read its traces.
            self._recorder = LightningProfilerTraces(trainer.profiler.dirpath, trainer.global_rank)
            self._recorder.start()
        elif kernel_steps:  # trainer.log_dir is a broadcast: every rank is here
            path = Path(trainer.log_dir) / "traces" / f"rank{trainer.global_rank}.pt.trace.json.gz"
            self._recorder = TraceRecorder(trainer.strategy.root_device, path, trainer.global_rank)
        # Without a profiler of its own, PhaseTimer slows no step.
        profiled = kernel_steps if self._recorder is not None and self._recorder.owns_profiler else 0
        self.profiled_steps = range(FIRST_PROFILED_STEP, FIRST_PROFILED_STEP + profiled)
        self._window, self._summaries = Window(self.profiled_steps), {phase: Sketch() for phase in PHASES}
        self._memory_window = Window(self.profiled_steps)
        # Lightning has no hook where the forward starts (after its own batch handling) nor where the
        # optimizer's step() returns: a forward pre-hook on the model Lightning calls, a step post-hook.
        self._handles = [
            trainer.strategy.model.register_forward_pre_hook(self._on_forward_start),
            trainer.optimizers[0].register_step_post_hook(self._on_optimizer_step_end),
        ]

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._counted and not pl_module.automatic_optimization:
            # training_step runs its own backward and update: counted as it runs, in step 0 (the warm-up).
            self._counted, self._rows = True, _rows(batch)
            self._real_flops.start()
        if not self._counted:
            # Once, on the real batch, before the first step's marks: FlopCounterMode runs an extra forward and
            # backward that must not count as step 0. One micro-batch's: the step's are that times their number.
            self._counted, self._rows = True, _rows(batch)
            try:
                self._flops = roofline.count_step_flops(pl_module, batch, batch_idx)
            except Exception as err:  # an exotic model must not stop training for a roofline
                rank_zero_warn(f"PhaseTimer: no roofline, counting FLOPs failed: {type(err).__name__}: {err}")
            self._marks = {}  # the count's forward went through the forward pre-hook
        step = trainer.global_step
        self._steps.batch_start(trainer)
        if not self._stepped and self._marks:  # no optimizer step yet: the next micro-batch of the same step
            mark = self._clock.mark()
            self._micro.append(close_micro_batch(self._marks, mark))
            self._marks = {"start": mark}
            return
        mark = self._mark("start")  # ends the step that ran
        self._close_step(mark)
        if self._toggle_recorder(step):
            mark = self._mark("start")  # the profiler's start-up or stop is in neither step
        self._step = step
        self._marks = {"start": mark}
        self._stepped = False
        self._resolve(trainer, block=False)

    def _toggle_recorder(self, step: int) -> bool:
        """Starts PhaseTimer's profiler at the first profiled step, stops it after the last (True if it did
        either); while a profiler runs (its own, or Lightning's PyTorchProfiler), opens the step's range."""
        recorder, toggled = self._recorder, False
        if recorder is None:
            return False
        if recorder.owns_profiler and not recorder.active and step == self.profiled_steps.start:
            recorder.start()
            toggled = True
        elif recorder.owns_profiler and recorder.active and step not in self.profiled_steps:
            self._stop_recorder()
            toggled = True
        if recorder.active:
            recorder.begin_step(step)
            if recorder.owns_profiler and self._memory.source is None and step > self.profiled_steps.start:
                # CPU: what the step starts with, for its allocator events to count from (lit_ddp.measure.memory).
                model, optimizers = self._training
                self._anchors[step] = memory.ddp_memory(model, optimizers, allocated_only=True).held
        return toggled

    def _stop_recorder(self) -> None:
        """Ends the profile (its trace written) and reads this rank's GPU-busy rows from the traces; rank 0 says
        once what came of it."""
        recorder = self._recorder
        steps = self.profiled_steps if recorder.owns_profiler else None  # Lightning's: the steps it recorded
        paths = recorder.stop()
        found = read_busy(paths, recorder.rank, steps)
        self._busy = found.rows
        rank_zero_info(describe(found, recorder.where, steps))
        for row in memory.cpu_step_memory(paths, recorder.rank, self._anchors):
            self._add_memory(row)

    def _mark(self, boundary: str) -> Any:
        if self._recorder is not None and self._recorder.active:
            self._recorder.mark(boundary)
        self._memory.mark(boundary)
        return self._clock.mark()

    def _mark_once(self, boundary: str) -> None:
        if boundary not in self._marks:
            self._marks[boundary] = self._mark(boundary)

    def _on_forward_start(self, module, args) -> None:
        self._mark_once("forward_start")

    @override
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._mark_once("forward_end")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._mark_once("forward_end")  # no zero_grad (e.g. accumulation): forward ends here
        self._marks["backward_start"] = self._mark("backward_start")
        self._real_flops.backward_start()

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._marks["backward_end"] = self._mark("backward_end")
        self._real_flops.backward_end()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._marks["update_start"] = self._mark("update_start")
        self._marks.pop("update_end", None)  # a second optimizer step in one batch (manual): its own update

    def _on_optimizer_step_end(self, optimizer, args, kwargs) -> None:
        self._marks["update_end"] = self._mark("update_end")
        if self._update_bytes is None:  # the state exists now and the gradients still do (manual: zeroed later)
            self._update_bytes = roofline.optimizer_update_bytes(optimizer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        scaler = grad_scaler(trainer)
        if "update_start" in self._marks and "update_end" not in self._marks and scaler is not None:
            # 16-mixed: the grad scaler found inf/NaN gradients and did not call optimizer.step() (no post-hook).
            self._skipped_count += 1
            self._skipped += [self._step][: MAX_SKIPPED_KEPT - len(self._skipped)]
        if "update_start" in self._marks:  # an optimizer without step post-hooks: the update ends by here
            self._mark_once("update_end")
        self._mark_once("data_start")  # from here to the next batch's start: fetching it, Lightning's loop
        # A step is an optimizer step: with gradient accumulation the batches before it are its micro-batches.
        self._stepped = self._steps.ended(trainer)
        if self._stepped and self._real_flops.active:
            self._flops, self._rows = self._real_flops.stop(), self._rows * (len(self._micro) + 1)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and self._marks:  # inside fit, after a training batch
            self._outside_start = self._clock.mark()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._outside_start is not None:  # kept out of the step it falls in: reported apart
            self._outside.append(("validation", self._outside_start, self._clock.mark()))
            self._outside_start = None

    def _close_step(self, end_mark: Any) -> None:
        """The step that was running ends where the next one starts (or training ends)."""
        if not self._marks:
            self._memory.drop()
            return
        row = self._memory.end_step(self._step)
        if row is not None:
            self._add_memory(row)
        marks = StepMarks(self._step, [*self._micro, close_micro_batch(self._marks, end_mark)], self._outside)
        if marks.complete():  # a step without an optimizer step, or that raised, has no phases to report
            self._pending.append(marks)
        self._marks, self._micro, self._outside = {}, [], []

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_step(self._mark("start"))
        if self._recorder is not None and self._recorder.active:
            self._stop_recorder()
        self._remove_hooks()
        self._resolve(trainer, block=True)
        self.log_dir = trainer.log_dir  # a broadcast: every rank asks
        kept = [row for _, row in self._memory_window.items()]
        ranks = gather_to_zero(trainer, RankPhases(trainer.global_rank, [row for _, row in self._window.items()],
                                                   self._summaries, self._busy, self._outside_summaries, kept,
                                                   self._memory_summaries))  # fmt: skip
        if ranks is not None and ranks[0].rows:
            source = self._memory.source or (memory.CPU_SOURCE if ranks[0].memory else None)
            self.record = PhaseRecord(meta(trainer, self._clock.name), ranks, list(self.profiled_steps),
                                      self._roofline(trainer, pl_module), skipped_steps=self._skipped,
                                      skipped_count=self._skipped_count, memory_source=source)  # fmt: skip
        self.ended = True
        report_timers(trainer, self)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A failed fit leaves no profiler running and no hook behind: the next fit in this process needs neither."""
        if isinstance(exception, torch.OutOfMemoryError):  # a rank in this process (ddp, torchrun, one device)
            self.on_out_of_memory(trainer, exception)
        if self._recorder is not None:
            self._recorder.close()
        self._remove_hooks()

    def on_out_of_memory(self, trainer: Trainer, exception: BaseException) -> None:
        """On the rank that ran out of memory, before the job ends (the other ranks may wait in a collective): one
        line naming the step and phase, where memory peaked and what held it, and ``oom_rank<r>.json`` beside the
        run's record. ``LitDDPStrategy`` calls it where the error is raised (a ``ddp_spawn``/``ddp_fork`` rank
        reaches no ``on_exception``), ``on_exception`` elsewhere; once per fit."""
        if self._oom_reported:
            return
        self._oom_reported = True
        model, optimizers = self._training
        allocated = torch.cuda.memory_allocated(self._memory.device) if self._memory.source else None
        rows = [row for _, row in self._memory_window.items()]
        top = max(rows, key=lambda m: m.peak["step"], default=None)
        peak, peak_step, peak_phase = (None, None, None)
        if top is not None:
            peak_step, peak = top.step, top.peak["step"]
            peak_phase = max((p for p in top.peak if p != "step"), key=top.peak.get, default=None)
        now = self._memory.peak_now()
        if now is not None and (peak is None or now > peak):  # the step running (not closed yet) peaked higher
            peak, peak_step, peak_phase = now, self._step, self._memory.phase
        run_dir = Path(self._run_dir or ".")
        rank = trainer.global_rank
        snapshot = None
        if self.memory_snapshot and self._memory.source:
            snapshot = str(run_dir / f"memory_snapshot_rank{rank}.pickle")
            _torch.dump_memory_snapshot(snapshot)
        error = next(iter(str(exception).strip().splitlines()), type(exception).__name__)
        oom = OutOfMemory(meta(trainer, self._clock.name), rank, self._step, self._memory.phase, error,
                          memory.ddp_memory(model, optimizers, allocated_only=True), allocated, peak, peak_step,
                          peak_phase, rows, self._memory.source, snapshot)  # fmt: skip
        path = save(oom, run_dir / f"oom_rank{rank}.json")
        print(f"lit-ddp: {oom_line(oom, str(path))}", file=sys.stderr, flush=True)

    def _add_memory(self, row: StepMemory) -> None:
        self._memory_window.add(row.step, row)
        self._memory_new.append(row)
        if is_steady(row.step, self._skipped):  # the profiled steps too: the allocator is not slowed
            for name, value in (("start", row.start), *((f"peak.{p}", v) for p, v in row.peak.items()),
                                *((f"retained.{p}", v) for p, v in row.retained.items())):  # fmt: skip
                self._memory_summaries.setdefault(name, Sketch()).add(value)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.memory_snapshot and self._memory.source:
            _torch.record_memory_history(False)
        self._real_flops.stop()  # a fit that failed in step 0 leaves no FLOP counter running either

    def _resolve(self, trainer: Trainer, block: bool) -> None:
        """Turns marks into milliseconds, oldest first, as far as they have completed."""
        for row in self._memory_new:
            metrics = {f"memory/{p}_{kind}_bytes": float(getattr(row, kind)[p]) for kind in ("peak", "retained")
                       for p in PHASES if p in getattr(row, kind)}  # fmt: skip
            log_metrics(trainer, metrics, step=row.step)
        self._memory_new = []
        while self._pending:
            marks = self._pending[0]
            end = marks.outside[-1][2] if marks.outside else marks.end  # a validation span may end last (CUDA)
            if block:
                self._clock.wait(marks.end)
                self._clock.wait(end)
            elif not (self._clock.ready(marks.end) and self._clock.ready(end)):
                return
            self._pending.pop(0)
            step = marks.step
            phases, offsets, outside = phases_of(marks, self._clock.elapsed_ms)
            self._window.add(step, StepRow(step, phases, offsets, len(marks.micro)))
            for what, values in outside.items():
                for value in values:
                    self._outside_summaries.setdefault(what, Sketch()).add(value)
            if is_steady(step, {*self.profiled_steps, *self._skipped}):
                for name in (*PHASES, "backward_last"):
                    self._summaries.setdefault(name, Sketch()).add(getattr(phases, name))
            self._publish(trainer, step, phases)

    def _publish(self, trainer: Trainer, step: int, phases: StepPhases) -> None:
        if step < self.print_steps:
            say(trainer, format_step(step, phases))
        log_metrics(trainer, {metric: getattr(phases, p) for metric, p in zip(METRICS, PHASES, strict=True)}, step=step)

    def _roofline(self, trainer: Trainer, pl_module: LightningModule) -> Roofline:
        dtype = _compute_dtype(trainer, pl_module)
        peak = roofline.peak_for(device_name(trainer.strategy.root_device), dtype)
        flops = self._flops or roofline.StepFlops(0, 0)
        # A step's work: the probe counted one micro-batch (automatic optimization), the real count the whole step.
        micro = getattr(trainer, "accumulate_grad_batches", 1) if pl_module.automatic_optimization else 1
        return Roofline(
            rows_per_rank=self._rows * micro,
            forward_flop=flops.forward * micro,
            backward_flop=flops.backward * micro,
            update_bytes=self._update_bytes or roofline.optimizer_update_bytes(trainer.optimizers[0]),
            peak_tflops=self.peak_tflops or (peak.tflops if peak else None),
            peak_gbps=self.peak_gbps or (peak.gbps if peak else None),
            peak_label="given" if self.peak_tflops or self.peak_gbps else (peak.label if peak else None),
            micro_batches=micro,
            compute_dtype=str(dtype).removeprefix("torch."),
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


def _rows(batch: Any) -> int:
    """Samples in the batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return _rows(batch[0])
    return 0
