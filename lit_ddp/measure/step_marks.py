"""One optimizer step as PhaseTimer marks it, and its phases: PhaseTimer's helper.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2 --trainer.accumulate_grad_batches 4

With gradient accumulation a step (docs/architecture.md) runs several batches (micro-batches), each with its own
marks (``lit_ddp.records.phases``: each phase's opening and closing mark), and one update, in the last one.
Each phase of the step is the sum of its spans over the micro-batches. Work inside fit that is no training step's
(validation, run by Lightning between two batches) is marked as a span of its own and taken out of the step and
of the ``data`` phase it falls in: it is reported apart (``RankPhases.outside``).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import Tensor

from lit_ddp.records import phases
from lit_ddp.records.phases import StepPhases


def required_marks() -> tuple[str, ...]:
    """What a step must have marked, in some micro-batch, for its phases to be reported: every mark but those of the
    phase that ends the micro-batch (data's start may be missing: its span then ends where it starts). A step without
    them (the step raised, no optimizer step) is left out."""
    closing = next((p.opens for p in phases.marked() if p.closes == phases.END), None)
    return ("start", *(b for b in phases.boundaries() if b not in (closing, phases.END)))


class OptimizerSteps:
    """Whether a training batch ended an optimizer step, for whoever acts once per step (a step:
    docs/architecture.md). Lightning advances ``trainer.global_step`` once per optimizer step, so a batch ended one
    when global_step moved while it ran: with gradient accumulation only the last micro-batch of a step does; under
    manual optimization, a batch whose ``training_step`` stepped an optimizer."""

    def __init__(self) -> None:
        self._at_start = 0

    def batch_start(self, trainer: Trainer) -> None:
        """From ``on_train_batch_start``."""
        self._at_start = trainer.global_step

    def ended(self, trainer: Trainer) -> bool:
        """From ``on_train_batch_end``: this batch ended an optimizer step (``trainer.global_step - 1``)."""
        return trainer.global_step != self._at_start


class Updates:
    """Whether the running step's updates ran, for the steps a grad scaler (``16-mixed``) skips: its owner calls
    ``begin`` from ``on_before_optimizer_step`` and ``ran`` from a step post-hook on every optimizer (manual
    optimization may step several). An update is skipped two ways (``torch.amp.GradScaler.step``): for most
    optimizers the scaler does not call ``optimizer.step()`` (no post-hook runs); for those that take the scaling in
    their own kernel (``fused=True``: ``_step_supports_amp_scaling``) it always calls it, with ``optimizer.found_inf``
    set for that call, and the kernel skips the update when it is non-zero."""

    def __init__(self) -> None:
        self.begun = 0
        self._ran = 0
        self._found_inf: list[Tensor] = []

    def begin(self) -> None:
        self.begun += 1

    def ran(self, optimizer: torch.optim.Optimizer) -> None:
        self._ran += 1
        found_inf = getattr(optimizer, "found_inf", None)  # set by the scaler for this call only (a fresh tensor)
        if isinstance(found_inf, Tensor):
            self._found_inf.append(found_inf)

    def skipped(self) -> bool | Tensor:
        """Whether an update of the step was skipped, and resets for the next step. A bool, or where only a fused
        optimizer's ``found_inf`` tells, a one-element tensor on its device (not read here: on CUDA reading it
        would wait for the GPU; read it once the step's work is done)."""
        missing, found, self.begun, self._ran, self._found_inf = self._ran < self.begun, self._found_inf, 0, 0, []
        if missing or not found:
            return missing
        return torch.stack([f.reshape(()) for f in found]).gt(0).any().reshape(1)


@dataclass
class StepMarks:
    """The marks of one optimizer step: per micro-batch, boundary -> mark (``start`` and ``end`` included), and
    the spans that belong to no training step, ``(what, start, end)``."""

    step: int
    micro: list[dict[str, Any]]
    outside: list[tuple[str, Any, Any]] = field(default_factory=list)
    memory: Any = None  # the step's StepMemory (CUDA), kept with it until its times are read
    skipped: bool | Tensor = False  # the grad scaler skipped its update (Updates.skipped)

    @property
    def end(self) -> Any:
        return self.micro[-1]["end"]

    def complete(self) -> bool:
        marked = {name for m in self.micro for name in m}
        return all(b in marked for b in required_marks())


def close_micro_batch(marks: dict[str, Any], end: Any) -> dict[str, Any]:
    """A micro-batch's marks, ended at ``end`` (the next batch's start, or the end of training)."""
    first = phases.marked()[0].opens  # the first phase opens at the micro-batch's start at the latest
    marks.setdefault(first, marks["start"])
    for phase in phases.marked():
        if phase.closes == phases.END:  # no batch end (the step raised, or a hand-driven timer)
            marks.setdefault(phase.opens, end)
    return {**marks, phases.END: end}


def phases_of(marks: StepMarks, elapsed: Callable[[Any, Any], float]) -> tuple[StepPhases, dict[str, float], dict]:
    """The step's phases (ms), where each boundary fell (ms from the step's start; for each boundary the last
    micro-batch's that has it: the one DDP all-reduces after) and the outside spans' ms by what they were."""
    sums = {}
    for phase in phases.marked():
        a, b = phase.opens, phase.closes
        sums[phase.name] = sum(elapsed(m[a], m[b]) for m in marks.micro if a in m and b in m)
    # The last micro-batch's backward: the one DDP all-reduces after.
    a, b = next((p.opens, p.closes) for p in phases.marked() if p.name == phases.ALL_REDUCING)
    backwards = [elapsed(m[a], m[b]) for m in marks.micro if a in m and b in m]
    outside: dict[str, list[float]] = {}
    for what, start, end in marks.outside:
        outside.setdefault(what, []).append(elapsed(start, end))
    away = sum(sum(v) for v in outside.values())  # inside a data span: between one batch's end and the next start
    step = elapsed(marks.micro[0]["start"], marks.end) - away
    # Work outside the step ran between a batch's end and the next start: inside the phase that ends a micro-batch.
    closing = next(p.name for p in phases.marked() if p.closes == phases.END)
    sums[closing] = max(0.0, sums[closing] - away)
    sums[phases.REMAINDER] = step - sum(sums.values())
    found = StepPhases(sums, step=step, backward_last=backwards[-1] if backwards else 0.0)
    start = marks.micro[0]["start"]
    offsets = {b: elapsed(start, next(m[b] for m in reversed(marks.micro) if b in m)) for b in phases.boundaries()}
    return found, offsets, outside
