"""One fit's phases on one rank: the state PhaseTimer makes fresh in each ``on_train_start``, as Lightning's
``ThroughputMonitor`` keeps a ``Throughput`` per stage. PhaseTimer's helper; the callback only wires it to the hooks.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

Steps are global step numbers, counted from the fit's first step (``first_step``: 0, or where a fit resumed from a
checkpoint): that step is the warm-up, its FLOPs are counted (``lit_ddp.measure.roofline.StepFlopCounter``), and
the profiled steps come ``FIRST_PROFILED_STEP`` after it. Marks become phases in ``lit_ddp.measure.step_marks``;
the record's parts and the steady-step rule are ``lit_ddp.records.schema``'s. Memory per phase: docs/memory.md.
"""

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer

from lit_ddp.measure import memory
from lit_ddp.measure.profiling import LightningProfilerTraces, TraceRecorder, describe, read_busy
from lit_ddp.measure.roofline import StepFlopCounter, StepFlops, optimizer_update_bytes
from lit_ddp.measure.step_marks import OptimizerSteps, StepMarks, Updates, close_micro_batch, phases_of
from lit_ddp.records import phases
from lit_ddp.records.schema import (
    MAX_SKIPPED_KEPT,
    OutOfMemory,
    RankPhases,
    RunMeta,
    Sketch,
    StepMemory,
    StepPhases,
    StepRow,
)
from lit_ddp.records.steps import Window, is_steady

FIRST_PROFILED_STEP = 2  # of the fit: after its warm-up step and one more (allocator, DDP's bucket rebuild)


class FitPhases:
    """Everything one fit measures on one rank, from its first step to its end.

    Args:
        first_step: The global step the fit starts from (``trainer.global_step`` in ``on_train_start``).
        clock: Marks and times the boundaries (``lit_ddp.measure.clock``).
        marks: Reads memory at each boundary (CUDA: ``memory.AllocatorMarks``; else ``memory.NoMarks``).
        recorder: PhaseTimer's own profiler, or Lightning's profiler's traces, or None.
        kernel_steps: Steps the recorder profiles when it owns its profiler, from ``FIRST_PROFILED_STEP`` on.
        training: The (DDP-)wrapped model and the optimizers, for what training holds.
        count_flops: Count the first step's FLOPs under ``FlopCounterMode``.
        report: Says a line on rank 0 (what came of the profile).
    """

    def __init__(self, first_step: int, clock: Any, marks: Any, recorder: Optional[TraceRecorder |
                 LightningProfilerTraces], kernel_steps: int, training: tuple[Any, Sequence[torch.optim.Optimizer]],
                 count_flops: bool, report: Callable[[str], None]) -> None:  # fmt: skip
        self.first_step, self.clock, self.memory, self.recorder = first_step, clock, marks, recorder
        self.training, self._report = training, report
        owned = kernel_steps if recorder is not None and recorder.owns_profiler else 0  # else no step is slowed
        start = first_step + FIRST_PROFILED_STEP
        self.profiled_steps = range(start, start + owned)
        self.window = Window(self.profiled_steps, first_step)  # each step's phases
        self.memory_window = Window(self.profiled_steps, first_step)  # each step's memory
        self.summaries: dict[str, Sketch] = {phase: Sketch() for phase in phases.with_step()}
        self.memory_summaries: dict[str, Sketch] = {}
        self.outside_summaries: dict[str, Sketch] = {}
        self.busy: list[StepRow] = []  # per profiled step: GPU-busy ms of each phase
        self.anchors: dict[int, int] = {}  # CPU: profiled step -> bytes held at its start
        self.skipped: list[int] = []  # steps the grad scaler skipped (16-mixed: inf/NaN gradients), the first kept
        self.skipped_count = 0
        self.counter = StepFlopCounter() if count_flops else None
        self.flops: Optional[StepFlops] = None
        self.flop_step: Optional[int] = None
        self.rows = 0  # samples of the counted step, all its micro-batches
        self._update_bytes: dict[int, int] = {}  # id(optimizer) -> its update's bytes, from its first step
        self.updates = Updates()
        self.step = first_step  # the step running
        self.new_memory: list[StepMemory] = []  # rows not yet given to the loggers
        self.oom_reported = False
        self._marks: dict[str, Any] = {}
        self._pending: list[StepMarks] = []  # steps whose marks are not resolved yet
        self._micro: list[dict[str, Any]] = []  # the running step's finished micro-batches (gradient accumulation)
        self._outside: list[tuple[str, Any, Any]] = []  # the running step's spans of no training step's work
        self._outside_start: Any = None
        self._steps, self._stepped = OptimizerSteps(), True  # the last batch's end made an optimizer step
        self._skipped_now: bool | torch.Tensor = False  # the running step's update skipped (Updates.skipped)

    def batch_start(self, trainer: Trainer, batch: Any) -> None:
        step = trainer.global_step
        self._steps.batch_start(trainer)
        if not self._stepped and self._marks:  # no optimizer step yet: the next micro-batch of the same step
            mark = self.clock.mark()
            self._micro.append(close_micro_batch(self._marks, mark))
            self._marks = {"start": mark}
            self.rows += _rows(batch) if self.step == self.first_step else 0
            return
        mark = self.mark("start")  # ends the step that ran
        self._close_step(mark)
        if self._toggle_recorder(step):
            mark = self.mark("start")  # the profiler's start-up or stop is in neither step
        self.step, self._marks, self._stepped = step, {"start": mark}, False
        if step == self.first_step:
            self.rows = _rows(batch)
            if self.counter is not None and self.flop_step is None:
                self.flop_step = step
                self.counter.start()

    def _toggle_recorder(self, step: int) -> bool:
        """Starts the own profiler at the first profiled step, stops it after the last (True if it did either);
        while a profiler runs (its own, or Lightning's PyTorchProfiler), opens the step's range."""
        recorder, toggled = self.recorder, False
        if recorder is None:
            return False
        if recorder.owns_profiler and not recorder.active and step == self.profiled_steps.start:
            recorder.start()
            toggled = True
        elif recorder.owns_profiler and recorder.active and step not in self.profiled_steps:
            self.stop_recorder()
            toggled = True
        if recorder.active:
            recorder.begin_step(step)
            if recorder.owns_profiler and self.memory.source is None and step > self.profiled_steps.start:
                # CPU: what the step starts with, for its allocator events to count from (lit_ddp.measure.memory).
                model, optimizers = self.training
                self.anchors[step] = memory.ddp_memory(model, optimizers, allocated_only=True).held
        return toggled

    def stop_recorder(self) -> None:
        """Ends the profile (its trace written) and reads this rank's GPU-busy rows and CPU memory from it."""
        recorder = self.recorder
        steps = self.profiled_steps if recorder.owns_profiler else None  # Lightning's: the steps it recorded
        paths = recorder.stop()
        found = read_busy(paths, recorder.rank, steps)
        self.busy = found.rows
        self._report(describe(found, recorder.where, steps))
        for row in memory.cpu_step_memory(paths, recorder.rank, self.anchors):
            self._add_memory(row)

    def mark(self, boundary: str) -> Any:
        if self.recorder is not None and self.recorder.active:
            self.recorder.mark(boundary)
        self.memory.mark(boundary)
        return self.clock.mark()

    def mark_once(self, boundary: str) -> None:
        if boundary not in self._marks:
            self._marks[boundary] = self.mark(boundary)

    def backward_start(self) -> None:
        self.mark_once("forward_end")  # no zero_grad (e.g. accumulation): forward ends here
        self._marks["backward_start"] = self.mark("backward_start")
        if self.counter is not None:
            self.counter.backward_start()

    def backward_end(self) -> None:
        self._marks["backward_end"] = self.mark("backward_end")
        if self.counter is not None:
            self.counter.backward_end()

    def update_start(self) -> None:
        self._marks["update_start"] = self.mark("update_start")
        self._marks.pop("update_end", None)  # a second optimizer step in one batch (manual): its own update
        self.updates.begin()
        if self.counter is not None:
            self.counter.update_start()

    def update_end(self, optimizer: torch.optim.Optimizer) -> None:
        """From each optimizer's step post-hook."""
        self._marks["update_end"] = self.mark("update_end")
        self.updates.ran(optimizer)
        if self.counter is not None:
            self.counter.update_end()
        if id(optimizer) not in self._update_bytes:  # its state exists now, its gradients still do (manual: zeroed
            self._update_bytes[id(optimizer)] = optimizer_update_bytes(optimizer)  # later); each optimizer's own

    @property
    def update_bytes(self) -> Optional[int]:
        """Bytes one step's updates move, every optimizer's (None before any ran)."""
        return sum(self._update_bytes.values()) if self._update_bytes else None

    def batch_end(self, trainer: Trainer, scaled: bool) -> None:
        """``scaled``: a grad scaler may skip the update (``16-mixed``)."""
        if "update_start" in self._marks:  # an optimizer without step post-hooks: the update ends by here
            self.mark_once("update_end")
        self.mark_once("data_start")  # from here to the next batch's start: fetching it, Lightning's loop
        # A step is an optimizer step: with gradient accumulation the batches before it are its micro-batches.
        self._stepped = self._steps.ended(trainer)
        if not self._stepped:
            return
        skipped = self.updates.skipped()
        self._skipped_now = skipped if scaled else False
        if self.counter is not None and self.counter.active:
            self.flops = self.counter.stop()

    def validation_start(self) -> None:
        if self._marks:  # inside fit, after a training batch
            self._outside_start = self.clock.mark()

    def validation_end(self) -> None:
        if self._outside_start is not None:  # kept out of the step it falls in: reported apart
            self._outside.append(("validation", self._outside_start, self.clock.mark()))
            self._outside_start = None

    def _close_step(self, end_mark: Any) -> None:
        """The step that was running ends where the next one starts (or training ends)."""
        if not self._marks:
            self.memory.drop()
            return
        marks = StepMarks(self.step, [*self._micro, close_micro_batch(self._marks, end_mark)], self._outside,
                          self.memory.end_step(self.step), self._skipped_now)  # fmt: skip
        self._skipped_now = False
        if marks.complete():  # a step without an optimizer step, or that raised, has no phases to report
            self._pending.append(marks)
        self._marks, self._micro, self._outside = {}, [], []

    def end(self) -> None:
        """Training ended: the last step closes, the profile stops (its trace written)."""
        self._close_step(self.mark("start"))
        if self.recorder is not None and self.recorder.active:
            self.stop_recorder()

    def close(self) -> None:
        """A failed fit leaves no profiler and no FLOP counter running."""
        if self.recorder is not None:
            self.recorder.close()
        if self.counter is not None:
            self.counter.stop()

    @property
    def pending(self) -> int:
        """Steps ended and not resolved yet."""
        return len(self._pending)

    def resolve(self, block: bool) -> list[tuple[int, StepPhases]]:
        """Turns marks into milliseconds, oldest first, as far as they have completed: the steps resolved."""
        done = []
        while self._pending:
            marks = self._pending[0]
            end = marks.outside[-1][2] if marks.outside else marks.end  # a validation span may end last (CUDA)
            if block:
                self.clock.wait(marks.end)
                self.clock.wait(end)
            elif not (self.clock.ready(marks.end) and self.clock.ready(end)):
                break
            self._pending.pop(0)
            step = marks.step
            if bool(marks.skipped):  # the step's work is done: reading a device flag waits for nothing now
                self.skipped_count += 1
                self.skipped += [step][: MAX_SKIPPED_KEPT - len(self.skipped)]
            if marks.memory is not None:
                self._add_memory(marks.memory)
            found, offsets, outside = phases_of(marks, self.clock.elapsed_ms)
            start_s = self.clock.host_seconds(marks.micro[0]["start"])  # for the timeline: every rank on one clock
            self.window.add(step, StepRow(step, found, offsets, len(marks.micro), start_s))
            for what, values in outside.items():
                for value in values:
                    self.outside_summaries.setdefault(what, Sketch()).add(value)
            if is_steady(step, {*self.profiled_steps, *self.skipped}, self.first_step):
                for name, ms in found.items():
                    self.summaries.setdefault(name, Sketch()).add(ms)
            done.append((step, found))
        return done

    def _add_memory(self, row: StepMemory) -> None:
        self.memory_window.add(row.step, row)
        self.new_memory.append(row)
        if is_steady(row.step, self.skipped, self.first_step):  # the profiled steps too: the allocator is not slowed
            for name, value in (("start", row.start), *((f"peak.{p}", v) for p, v in row.peak.items()),
                                *((f"retained.{p}", v) for p, v in row.retained.items())):  # fmt: skip
                self.memory_summaries.setdefault(name, Sketch()).add(value)

    def rank_phases(self, rank: int) -> RankPhases:
        """This rank's part of the record, once training ended."""
        return RankPhases(rank, [row for _, row in self.window.items()], self.summaries, self.busy,
                          self.outside_summaries, [row for _, row in self.memory_window.items()],
                          self.memory_summaries)  # fmt: skip

    def out_of_memory(self, meta: RunMeta, rank: int, error: str, snapshot: Optional[str]) -> OutOfMemory:
        """What this rank held when it ran out of memory in the running step, and where memory peaked before."""
        model, optimizers = self.training
        allocated = torch.cuda.memory_allocated(self.memory.device) if self.memory.source else None
        # The steps whose times are not read yet too (CUDA: a step or two behind).
        rows = [*(row for _, row in self.memory_window.items()), *(m.memory for m in self._pending if m.memory)]
        top = max(rows, key=lambda m: m.peak["step"], default=None)
        peak, peak_step, peak_phase = (None, None, None)
        if top is not None:
            peak_step, peak = top.step, top.peak["step"]
            peak_phase = max((p for p in top.peak if p != "step"), key=top.peak.get, default=None)
        now = self.memory.peak_now()
        if now is not None and (peak is None or now > peak):  # the step running (not closed yet) peaked higher
            peak, peak_step, peak_phase = now, self.step, self.memory.phase
        return OutOfMemory(meta, rank, self.step, self.memory.phase, error,
                           memory.ddp_memory(model, optimizers, allocated_only=True), allocated, peak, peak_step,
                           peak_phase, rows, self.memory.source, snapshot)  # fmt: skip


def _rows(batch: Any) -> int:
    """Samples in the batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return _rows(batch[0])
    return 0
