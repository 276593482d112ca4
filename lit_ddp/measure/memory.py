"""What DDP training holds in memory, exactly, and what each phase of a step takes: PhaseTimer's and CommMonitor's
helper.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2    # memory per phase, DDP's buckets

``ddp_memory`` reads the live objects: parameters, gradients, DDP's gradient buckets (DDP's own layout) and the
optimizer's state. Per phase: on CUDA ``AllocatorMarks`` reads the caching allocator at each boundary PhaseTimer
marks in the first ``MEASURED_STEPS`` (its peak since the last one, then reset; no synchronize; after them the
peak is the user's again); on CPU ``cpu_step_memory`` reads the CPU
allocator's events in the profiled steps' traces, anchored on what ``ddp_memory`` sees held at each step's start.
What each figure means: docs/memory.md.
"""

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from lit_ddp._torch import ddp_logging_data
from lit_ddp.derive import trace, trace_memory
from lit_ddp.measure.profiling import opens
from lit_ddp.records import phases
from lit_ddp.records.schema import DDPMemory, StepMemory
from lit_ddp.records.steps import HEAD_STEPS


# The phase each of PhaseTimer's boundaries opens (a step's start opens "other" until its forward starts).
def phase_opened() -> dict[str, str]:
    """Mark -> the phase that runs from it (the remainder from a step's start)."""
    named = phases.ranges()
    return {"start": phases.REMAINDER, **{boundary: named[name] for boundary, name in opens().items()}}


CUDA_SOURCE, CPU_SOURCE = "cuda_allocator", "cpu_profiler"
# On CUDA the steps whose phases get their own peak: the record's first steps (``HEAD_STEPS``). Only there is the
# allocator's peak reset at every boundary; from then on ``torch.cuda.max_memory_allocated`` and Lightning's
# ``DeviceStatsMonitor`` see the peak as if the tool were not there (since the end of the last measured step).
MEASURED_STEPS = HEAD_STEPS


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_layout(model: Any) -> list[int]:
    """DDP's gradient buckets, bytes each: the layout it rebuilt after the first step, else the one it was built
    with; empty for a model that is not DDP."""
    data = ddp_logging_data(model)
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(size) for size in str(sizes).split(",") if size.strip()]


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor in the optimizers' state (Adam: exp_avg, exp_avg_sq and a step count per parameter)."""
    tensors = {id(v): v for opt in optimizers for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)}  # fmt: skip
    return sum(_bytes(t) for t in tensors.values())


def ddp_memory(model: Any, optimizers: Sequence[torch.optim.Optimizer], compression: Optional[str] = None,
               allocated_only: bool = False) -> DDPMemory:  # fmt: skip
    """What training holds, from the live ``model`` (DDP-wrapped or not) and ``optimizers``.

    Args:
        compression: The comm hook's cast for the all-reduce (``fp16``, ``bf16``), to say what it changes.
        allocated_only: Count only the gradients allocated now (the others are None): what is held at this moment.
    """
    module = model.module if isinstance(model, DistributedDataParallel) else model
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    if allocated_only:
        gradients = sum(_bytes(p.grad) for p in trainable if p.grad is not None)
    else:
        gradients = sum(_bytes(p) for p in trainable)
    return DDPMemory(
        parameters=sum(_bytes(p) for p in params),
        gradients=gradients,
        buckets=bucket_layout(model),
        gradient_as_bucket_view=bool(getattr(model, "gradient_as_bucket_view", False)),
        optimizer_state=optimizer_state_bytes(optimizers),
        bucket_cap=int(getattr(model, "bucket_bytes_cap", 0) or 0),
        compression=compression,
    )


def step_memory(step: int, start: int, intervals: Sequence[tuple[str, int, int]]) -> StepMemory:
    """A step from its ``(phase, peak, held at the end)`` intervals in time order: each phase's peak is its
    intervals' highest, what it retained is held at the end of its last one."""
    peak: dict[str, int] = {"step": max([start, *(p for _, p, _ in intervals)])}
    retained: dict[str, int] = {"step": intervals[-1][2] if intervals else start}
    for phase, high, end in intervals:
        peak[phase] = max(peak.get(phase, 0), high)
        retained[phase] = end
    return StepMemory(step, start, peak, retained)


class AllocatorMarks:
    """CUDA: at each boundary PhaseTimer marks in the first ``steps`` steps, the caching allocator's peak since the
    last boundary and what it holds now (one ``memory_stats`` read), then its peak reset. Host calls into the
    allocator, which counts a tensor when the CPU allocates it: nothing waits for the GPU. Resetting the peak
    takes ``torch.cuda.max_memory_allocated`` from anyone else meanwhile (Lightning's ``DeviceStatsMonitor``
    reports the peak between two of PhaseTimer's boundaries then); after those steps nothing is reset or read."""

    source = CUDA_SOURCE

    def __init__(self, device: torch.device, steps: int = MEASURED_STEPS) -> None:
        self.device = device
        self.phase = phases.REMAINDER  # the phase running now
        self._opened = phase_opened()
        self.steps_left = steps
        self._intervals: list[tuple[str, int, int]] = []
        self._start = self._read()[1]
        torch.cuda.reset_peak_memory_stats(device)

    def _read(self) -> tuple[int, int]:
        """The allocator's peak since its last reset and what it holds now, from one ``memory_stats`` (each of
        ``max_memory_allocated`` and ``memory_allocated`` builds the whole dictionary)."""
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("allocated_bytes.all.peak", 0), stats.get("allocated_bytes.all.current", 0)

    def mark(self, boundary: str) -> None:
        if self.steps_left > 0:
            peak, now = self._read()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._intervals.append((self.phase, peak, now))
        self.phase = self._opened.get(boundary, self.phase)

    def end_step(self, step: int) -> Optional[StepMemory]:
        """The step whose boundaries were marked since the last call (None once ``steps`` were measured); the next
        one starts where it ended."""
        if self.steps_left <= 0:
            return None
        found = step_memory(step, self._start, self._intervals)
        self.drop()
        self.steps_left -= 1
        return found

    def drop(self) -> None:
        """Forgets the marks since the last step (no step ran between them)."""
        if self._intervals:
            self._start = self._intervals[-1][2]
        self._intervals = []

    def peak_now(self) -> int:
        """The most held since the last boundary (an out-of-memory error: before the failed allocation); after the
        measured steps, since the end of the last of them."""
        return torch.cuda.max_memory_allocated(self.device)


class NoMarks:
    """CPU: nothing to read at a boundary (the profiled steps' traces hold the allocator's events)."""

    source = None

    def __init__(self) -> None:
        self.phase = phases.REMAINDER
        self._opened = phase_opened()

    def mark(self, boundary: str) -> None:
        self.phase = self._opened.get(boundary, self.phase)

    def end_step(self, step: int) -> None:
        return None

    def drop(self) -> None:
        pass

    def peak_now(self) -> None:
        return None


def marks_for(device: torch.device) -> AllocatorMarks | NoMarks:
    return AllocatorMarks(device) if device.type == "cuda" else NoMarks()


def cpu_step_memory(paths: Iterable[Path], rank: int, anchors: dict[int, int]) -> list[StepMemory]:
    """The steps of ``anchors`` (step -> bytes held at its start, ``ddp_memory(..., allocated_only=True).held``)
    from ``rank``'s traces among ``paths``: the anchor plus what the CPU allocator's events add since the step's
    start. A trace that is not one, or another rank's, is passed over.

    The profiler sees only the allocations made while it runs: a tensor allocated before it started frees unseen.
    So the first profiled step (which frees the gradients and activations of the step before) is left out by the
    caller: from the second one on, every tensor freed was allocated in sight.
    """
    found: dict[int, StepMemory] = {}
    known = phases.with_step()
    for path in paths:
        try:
            loaded = trace.load(path)
        except trace.TraceError:
            continue
        if loaded.rank != rank:
            continue
        for step in trace_memory.step_memory(loaded):
            anchor = anchors.get(step.step)
            if anchor is None:
                continue
            peak = {p: anchor + max(v, 0) for p, v in step.peak.items() if p in known}
            retained = {p: anchor + v for p, v in step.retained.items() if p in known}
            found[step.step] = StepMemory(step.step, anchor, peak, retained)
    return [found[s] for s in sorted(found)]
