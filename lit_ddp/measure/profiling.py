"""The profiled steps' trace, kept: PhaseTimer's ``torch.profiler`` over a few steady steps writes each rank's
Chrome trace into the run's log dir, and the GPU-busy time of each phase is read back from it by
``lit_ddp.derive.trace``. PhaseTimer's helper.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 1    # on a GPU: steps 2-4 profiled
    python -m lit_ddp.report --trace runs/mini_train_profile/version_0/traces     # the kept traces, any time later

PhaseTimer's ``record_function`` ranges (``lit_ddp.step#N``, and one phase range inside it at every moment) go
into the trace; with Lightning's ``PyTorchProfiler`` no profiler of its own is started and that one's traces are
read instead. Why a trace and not marker kernels, and how ops are given to phases: docs/traces.md.
"""

import os
import re
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lit_ddp.derive import trace
from lit_ddp.records import phases, ranges
from lit_ddp.records.phases import StepPhases
from lit_ddp.records.schema import StepRow


# The phase range each boundary opens, closing the one open before. One is open at every moment of a step, so an
# op queued between two phases is "other", not given to a range around the phases (torch's Optimizer.step#...step
# holds Lightning's whole closure). lit_ddp.derive.trace takes the innermost range: one opened inside ours
# (Lightning's # profiler's [Strategy]...training_step, begun just before the forward pre-hook) keeps what it holds.
def opens() -> dict[str, str]:
    """Mark -> the profiler range it opens (``lit_ddp.records.phases``): a phase's opening mark its own, its closing
    mark the remainder's."""
    remainder = phases.range_of(phases.REMAINDER)
    found = {p.opens: p.profiler_range for p in phases.marked()}
    return {**{p.closes: remainder for p in phases.marked() if p.closes != phases.END}, **found}


def enter_range(name: str) -> record_function:
    """A ``record_function`` range opened now, closed by its ``__exit__``: a step spans several hooks, so no
    ``with`` block can hold it."""
    opened = record_function(name)
    opened.__enter__()
    return opened


class Ranges:
    """The tool's ranges: ``lit_ddp.step#N`` from ``begin_step(N)`` to the next one (or ``close``), and inside it
    one phase range from each boundary ``mark``ed to the next. ``enter`` opens a range (a stand-in in tests)."""

    def __init__(self, enter: Callable[[str], Any] = enter_range) -> None:
        self._enter = enter
        self._opens = opens()
        self._remainder = phases.range_of(phases.REMAINDER)
        self._open: list[Any] = []  # the step's range, then its phase's

    def begin_step(self, step: int) -> None:
        self._end_ranges()
        self._open = [self._enter(f"{ranges.STEP_PREFIX}{step}"), self._enter(self._remainder)]

    def mark(self, boundary: str) -> None:
        name = self._opens.get(boundary)
        if name is not None and self._open:
            self._open.pop().__exit__(None, None, None)
            self._open.append(self._enter(name))

    def close(self) -> None:
        self._end_ranges()

    def _end_ranges(self) -> None:
        while self._open:  # the phase first: ranges end in the order they nest
            self._open.pop().__exit__(None, None, None)


class TraceRecorder(Ranges):
    """PhaseTimer's own profiler from ``start`` to ``stop`` (CPU activity, and CUDA's on a CUDA device) with the
    tool's ranges; ``stop`` writes the trace to ``path``. ``close`` ends it without a trace (a failed fit)."""

    owns_profiler = True

    def __init__(self, device: torch.device, path: Path, rank: int) -> None:
        self.path, self.rank = Path(path), rank
        self.where = self.path.parent  # where the ranks' traces go
        self.activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
        # On CPU the allocator's events are the only memory figures there are (lit_ddp.measure.memory); on CUDA the
        # caching allocator is read directly, at no profiling cost.
        self.profile_memory = device.type == "cpu"
        super().__init__()
        self._profile: Optional[profile] = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        # record_shapes: ProcessGroupNCCL's collectives then carry their sizes into the trace (trace_report's bytes).
        self._profile = profile(activities=self.activities, record_shapes=True, profile_memory=self.profile_memory)
        before = torch.empty(1) if self.profile_memory else None  # a block the profile did not see allocated
        with profiler_chatter_hidden():
            self._profile.__enter__()
            # Its free is the first of a block the CPU allocator's reporter does not know: torch warns on every
            # 1000th such free from its first (CPUAllocator.cpp, a count kept per process, across profiles), one
            # line per rank in a profiled step. Spent here, inside the window whose chatter is hidden, the next
            # warning would need 1000 more, which a few profiled steps do not reach (the profiled config: none).
            del before

    def close(self) -> None:
        super().close()
        if self._profile is not None:
            with profiler_chatter_hidden():
                self._profile.__exit__(None, None, None)  # on CUDA this synchronizes: every op queued so far is in
            self._profile = None

    def stop(self) -> list[Path]:
        """Ends profiling and writes the trace (a ``.gz`` path: torch gzips it); returns ``[path]``."""
        prof = self._profile
        assert prof is not None, "start() first"
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        return [self.path]


# What torch's profiler (Kineto) prints on stderr from C++ as it starts and stops, on every rank: "USDT: ...
# profiler_start" (torch >= 2.13), its stages, and on a CUDA build without a GPU "ERROR: ... gpuGetDeviceCount
# failed"; and the CPU allocator's line for the block PhaseTimer frees at the start of a memory profile (``start``).
# Not the user's to act on.
PROFILER_CHATTER = re.compile(
    r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\]"
    r"|^ERROR:\S+ \S+ \d+:\d+ DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed"
    r"|^(\[rank\d+\]:)?\[W\S+ \S+ CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the "
    r"profiling started"
)


@contextmanager
def profiler_chatter_hidden() -> Iterator[None]:
    """stderr (the file descriptor, where C++ writes) goes to a file meanwhile; every line but the profiler's
    chatter is written back, in order, when it ends."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        try:
            os.dup2(caught.fileno(), 2)
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not PROFILER_CHATTER.match(line)]  # fmt: skip
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class LightningProfilerTraces(Ranges):
    """While Lightning's ``PyTorchProfiler`` profiles, the tool's ranges in every step (``start`` to ``stop``), and
    at ``stop`` the Chrome traces it wrote into ``dirpath`` since this object was made."""

    owns_profiler = False

    def __init__(self, dirpath: Optional[str | Path], rank: int) -> None:
        self.dirpath, self.rank = (Path(dirpath) if dirpath else None), rank
        self.where = self.dirpath
        super().__init__()
        self.active = False
        self._before = set(self._written())

    def _written(self) -> list[Path]:
        if self.dirpath is None or not self.dirpath.is_dir():
            return []
        return sorted(p for pattern in ("*.pt.trace.json", "*.pt.trace.json.gz") for p in self.dirpath.glob(pattern))

    def start(self) -> None:
        self.active = True

    def close(self) -> None:
        super().close()
        self.active = False

    def stop(self) -> list[Path]:
        self.close()
        return [p for p in self._written() if p not in self._before]


class Busy(NamedTuple):
    """What one rank's traces gave: GPU-busy rows of its steps, the traces of this rank holding the tool's steps,
    and whether any held GPU ops (a CPU-only profile has none: no busy time, rather than zeros)."""

    rows: list[StepRow]
    traces: list[Path]
    gpu: bool


def read_busy(paths: Iterable[Path], rank: int, steps: Optional[Collection[int]] = None) -> Busy:
    """GPU-busy ms of each phase and of the whole step, per ``lit_ddp.step#N`` range in the traces of ``rank``
    among ``paths``, through ``lit_ddp.derive.trace``. A trace that is not one, is another rank's, or holds none
    of the tool's step ranges is passed over.

    Args:
        steps: The steps PhaseTimer's own profiler ran over, stopped between steps: all of them whole. None: the
            traces of a profiler that stops inside a step (Lightning's, at the end of each cycle of its schedule):
            the last step of each trace is left out, as cut.
    """
    rows: dict[int, StepRow] = {}
    traces, gpu = [], False
    for path in paths:
        try:
            found = trace.load(path)
        except trace.TraceError:
            continue
        if found.rank != rank or not any(r.name.startswith(ranges.STEP_PREFIX) for r in found.ranges):
            continue
        traces.append(path)
        if not found.ops:
            continue
        gpu = True
        own = sorted((r for r in found.ranges if r.name.startswith(ranges.STEP_PREFIX)), key=lambda r: r.start_us)
        wanted = set(steps) if steps is not None else {int(r.name.removeprefix(ranges.STEP_PREFIX)) for r in own[:-1]}
        for step in trace.analyze_rank(found).steps:  # a profiler's stop waits for the GPU: no GPU tail is missing
            if step.step in wanted:
                rows[step.step] = busy_row(step)
    return Busy([rows[s] for s in sorted(rows)], traces, gpu)


def busy_row(step: trace.StepAnalysis) -> StepRow:
    """One step's GPU-busy ms per phase (0 for a phase that queued no GPU op) and of the step (the union)."""
    ms = {p: step.phases[p].busy_us / 1e3 if p in step.phases else 0.0 for p in phases.names()}
    return StepRow(step.step, StepPhases(ms, step=step.breakdown.busy_us / 1e3), {})


def describe(busy: Busy, where: Optional[Path], steps: Optional[range] = None) -> str:
    """PhaseTimer's one line about the profile (rank 0's): where the traces are and what came of them. ``steps``:
    those its own profiler ran over; None: Lightning's PyTorchProfiler ran."""
    read = f"python -m lit_ddp.report --trace {where}"
    own = steps is not None
    which = "" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    if own and busy.gpu:
        return f"PhaseTimer: {which} profiled; every rank's trace is in {where} ({read})"
    if own:
        return (f"PhaseTimer: {which} profiled, CPU activity only: the traces hold no GPU events, so there is no "
                f"GPU-busy column; every rank's trace is in {where}")  # fmt: skip
    if not busy.traces:
        return (f"PhaseTimer: no trace of Lightning's PyTorchProfiler with PhaseTimer's steps in {where} by the end "
                "of training (it writes one after each cycle of its schedule and the last at teardown), so there is "
                f"no GPU-busy column; {read} reads them afterwards")  # fmt: skip
    count = f"{len(busy.traces)} trace(s) of Lightning's PyTorchProfiler in {where}"
    if not busy.gpu:
        return f"PhaseTimer: {count} hold no GPU events (a CPU-only profile), so there is no GPU-busy column"
    return f"PhaseTimer: GPU-busy time of {len(busy.rows)} step(s) from {count} ({read})"
