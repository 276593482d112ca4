"""The GPU check: what only a CUDA machine can tell about the port, in one report (meant to take under 4 minutes on
one H200; sized, not yet timed there).

    python benchmarks/gpu_check.py gpu_check.txt
    python benchmarks/gpu_check.py out.txt --sections syncs,busy --quick

Prints one report and writes the same text to OUT, section by section (a run cut short keeps what it measured).
Without a CUDA device it exits 2 with one line, before anything else; it exits 1 when a section crashed (the
traceback is in the report) and 0 otherwise: a missed target is a finding, listed in the verdicts at the end.

Sections (``--sections``, comma-separated, all but ``tests`` by default; the header always comes first):

tests    ``pytest -k "cuda or gpu"`` (slow ones included) in a child process: how many tests ran, passed,
         failed, were skipped and why. Zero tests run is reported as such, never as a pass.
syncs    host syncs per steady step and their call sites, from ``torch.cuda.set_sync_debug_mode("warn")`` over
         steps 11..20 of an in-process 1-GPU fit: with the tool's per-step work off (target 0), and with
         LossMonitor printing every step (1 expected: StepSync's host read), which shows that the counter works.
busy     PhaseTimer's GPU-busy time against torch.profiler's own figures for the same steps (within 5%?).
events   PhaseTimer's CUDA-event phase times against a plain loop timed with ``synchronize()``.
scaling  ms per step on one GPU: the notes' plain loop against the port's default config and
         ``configs/fast.yaml``, dims 1024/4096/8192, batch 32/1024, and where the port's overhead drops under 5%.

Each section's function says what it measures and why that way. All of them train the notes' model
(``LinearRegression``: one ``Linear(dim, dim)``, Adam) on ``FixedBatchDataModule``'s batch with
``LitDDPStrategy`` on one GPU (DDP over a 1-rank NCCL group, as ``--devices 1`` runs it). In-process fits
destroy their process group and restore the environment after themselves.
"""

import argparse
import contextlib
import functools
import io
import json
import linecache
import logging
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, Optional
from unittest import mock

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.autograd import DeviceType
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from typing_extensions import override

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, SyncCheck, kernels
from lit_ddp.callbacks.kernels import MARK_PREFIX
from lit_ddp.callbacks.phase_timer import FIRST_PROFILED_STEP
from lit_ddp.data import shard
from lit_ddp.strategy import LitDDPStrategy

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("tests", "syncs", "busy", "events", "scaling")
# The tests take minutes of the budget (each `python -m lit_ddp.fit` they start pays the ~13 s start-up): a GPU
# session runs pytest itself, or asks for them with --sections tests,...
DEFAULT_SECTIONS = SECTIONS[1:]
PHASES = ("forward", "backward", "update")
DIM, BATCH = 4096, 32  # the profile config's model (configs/mini_train_profile.yaml), the notes' batch
SCALING_SHAPES = [(dim, batch) for dim in (1024, 4096, 8192) for batch in (32, 1024)]
KERNEL_STEPS = 3  # PhaseTimer's default number of profiled steps on CUDA
LIMIT = 0.05  # "agree" and "overhead" threshold
STEP_CLOCK = "benchmarks.step_clock.StepClock"
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lit_ddp")
SYNC_MESSAGE = "synchronizing CUDA operation"  # the TORCH_WARN of c10::cuda::warn_or_error_on_sync
# The environment the check started with, before any in-process fit wrote Lightning's variables into it.
CLEAN_ENV: dict[str, str] = dict(os.environ)
# `python -m lit_ddp.reference` for several configurations in one interpreter (one start-up instead of one per
# configuration); each main() builds and destroys its own 1-rank process group and writes its own timings.
REFERENCE_DRIVER = """
import json, sys
from lit_ddp import reference
for argv in json.loads(sys.argv[1]):
    reference.main(argv)
"""


@dataclass(frozen=True)
class Budget:
    """Step counts and time limits; ``--quick`` roughly halves the steps."""

    # The first counted step: after DDP's first 10 iterations, at whose forward its reducer waits for the previous
    # step's CUDA events (runtime stats, reducer.cpp should_collect_runtime_stats; again every 100th), a
    # cudaEventSynchronize that set_sync_debug_mode does not see.
    sync_first: int = 11
    sync_steps: int = 10
    fit_steps: int = 30  # the profiled fit shared by the busy and events sections
    loop_steps: int = 30
    loop_warmup: int = 3
    scaling_steps: int = 40
    scaling_warmup: int = 5
    tests_timeout_s: int = 300
    reference_timeout_s: int = 180


QUICK = Budget(sync_steps=5, fit_steps=20, loop_steps=16, scaling_steps=20, scaling_warmup=4, tests_timeout_s=240)


@dataclass
class Section:
    """One part of the report: its lines, and one-line verdicts repeated at the end."""

    title: str
    lines: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    crashed: bool = False


# ---------------------------------------------------------------------------------------------- pure helpers


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt_ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def fmt_pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.1%}"


def fmt_share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """Text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(padded).rstrip())
    return lines


class PytestSummary(NamedTuple):
    counts: dict[str, int]  # passed, failed, skipped, errors, deselected, xfailed, xpassed, warnings
    outcomes: list[tuple[str, str]]  # ("PASSED", "tests/x.py::test_y"), ("SKIPPED", "[1] tests/x.py:3: reason")
    line: str  # pytest's final line

    @property
    def ran(self) -> int:
        return sum(self.counts.get(k, 0) for k in ("passed", "failed", "xfailed", "xpassed"))


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b")
_PYTEST_OUTCOME = re.compile(r"^(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (.+)$")


def parse_pytest(stdout: str) -> PytestSummary:
    """Counts from pytest's final line (``4 passed, 2 skipped, 189 deselected in 20.1s``), outcomes from its
    ``-rA`` short summary."""
    lines = stdout.strip().splitlines()
    final = next((line for line in reversed(lines) if re.search(r"\bin [\d.]+s\b", line)), "")
    counts: dict[str, int] = {}
    for number, word in _PYTEST_COUNT.findall(final):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[key] = counts.get(key, 0) + int(number)
    outcomes = [(m.group(1), m.group(2)) for line in lines if (m := _PYTEST_OUTCOME.match(line))]
    return PytestSummary(counts, outcomes, final.strip("= "))


def sum_ms(intervals: Iterable[tuple[float, float]], start: float = -math.inf, end: float = math.inf) -> float:
    """Sum of the intervals' lengths inside ``[start, end]``: overlapping time counts twice, unlike ``union_ms``."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in intervals)


class GpuActivity(NamedTuple):
    """The GPU side of a torch.profiler trace, on the profiler's clock, in ms."""

    kernels: list[tuple[float, float]]  # kernels, memcpy, memset: the GPU's work, PhaseTimer's markers excluded
    markers: list[tuple[str, float, float]]  # PhaseTimer's marker kernels, ("7:forward_end", start, end), in order
    annotations: list[tuple[str, float, float]]  # GPU user annotations: record_function ranges on the GPU timeline


def gpu_activity(events: Iterable[kernels.TraceEvent]) -> GpuActivity:
    """Sorts a profile's raw events (``kernels.trace_events``) into kernels, PhaseTimer's markers and GPU user
    annotations.

    A marker is found through its GPU user annotation: kineto draws each ``lit_ddp::mark::N:boundary``
    record_function on the GPU timeline over the one kernel launched inside it. This uses neither the correlation
    ids nor the CPU-side matching that ``KernelRecorder`` uses, so that the two can be held against each other.
    """
    events = list(events)
    annotations = [(e.name, e.start_ms, e.end_ms) for e in events
                   if e.device_type == DeviceType.CUDA and e.is_user_annotation]  # fmt: skip
    markers = sorted((m for m in annotations if m[0].startswith(MARK_PREFIX)),
                     key=lambda m: int(m[0][len(MARK_PREFIX) :].split(":", 1)[0]))  # fmt: skip
    work = [
        (e.start_ms, e.end_ms)
        for e in filter(kernels.is_gpu_work, events)
        if not any(s <= e.start_ms and e.end_ms <= t for _, s, t in markers)
    ]
    others = [a for a in annotations if not a[0].startswith(MARK_PREFIX)]
    return GpuActivity(work, [(n[len(MARK_PREFIX) :], s, t) for n, s, t in markers], others)


def steady_step_ms(starts: Sequence[Sequence[float]], warmup: int) -> float:
    """Median step time (ms) over ranks and steps from each rank's step start marks (the last mark ends the last
    step), the first ``warmup`` steps dropped: ``benchmarks/step_time.py``'s measure. On a GPU every mark comes
    after the GPU finished the step before (the plain loop reads the loss, ``StepClock`` synchronizes)."""
    return median((b - a) * 1e3 for rank in starts for a, b in zip(rank[warmup:], rank[warmup + 1 :], strict=False))


def read_step_starts(out_dir: Path) -> list[list[float]]:
    """``step_starts`` of every ``rank<r>.json`` in ``out_dir`` (written by the reference and by StepClock)."""
    files = sorted(out_dir.glob("rank*.json"))
    if not files:
        raise RuntimeError(f"no rank*.json in {out_dir}: the run wrote no step timings")
    return [json.loads(p.read_text())["step_starts"] for p in files]


class ScalingRow(NamedTuple):
    dim: int
    batch: int
    plain: float  # ms per step: the notes' loop, torch's default Adam
    plain_fused: float  # the same with --fused
    port: float  # the port's default config
    port_fast: float  # configs/fast.yaml

    @property
    def overhead(self) -> float:
        return ratio(self.port, self.plain) - 1

    @property
    def fast_overhead(self) -> float:
        return ratio(self.port_fast, self.plain_fused) - 1


def scaling_rows(rows: Sequence[ScalingRow]) -> list[tuple]:
    return [
        (r.dim, r.batch, fmt_ms(r.plain), fmt_ms(r.plain_fused), fmt_ms(r.port), fmt_ms(r.port_fast),
         fmt_pct(r.overhead), fmt_pct(r.fast_overhead))
        for r in rows
    ]  # fmt: skip


def under_limit_from(
    rows: Sequence[ScalingRow], overhead: Callable[[ScalingRow], float], limit: float = LIMIT
) -> Optional[ScalingRow]:
    """The first of ``rows`` (ordered from small to large work) from which on every row's overhead is under
    ``limit``; None when the last row's is not."""
    found = None
    for row in reversed(rows):
        if not overhead(row) < limit:
            break
        found = row
    return found


def under_limit_line(rows: Sequence[ScalingRow], overhead: Callable[[ScalingRow], float], what: str) -> str:
    first = under_limit_from(rows, overhead)
    if first is None:
        return f"{what}: the port's per-step overhead falls under {LIMIT:.0%} nowhere in this table"
    where = f"from dim {first.dim} / batch {first.batch} on"
    everywhere = " (everywhere in this table)" if first is rows[0] else ""
    return f"{what}: the port's per-step overhead falls under {LIMIT:.0%} {where}{everywhere}"


class SyncSite(NamedTuple):
    path: str  # relative to the repository, or to site-packages
    line: int
    code: str


def short_path(filename: str) -> str:
    path = Path(filename)
    with contextlib.suppress(ValueError, OSError):
        return str(path.resolve().relative_to(ROOT))
    for anchor in ("site-packages", "dist-packages"):
        if anchor in path.parts:
            return "/".join(path.parts[path.parts.index(anchor) + 1 :])
    return filename


def sync_sites(caught: Iterable[warnings.WarningMessage]) -> list[SyncSite]:
    """The sync warnings among ``caught``, each as the Python line that called into torch."""
    return [
        SyncSite(short_path(w.filename), w.lineno, linecache.getline(w.filename, w.lineno).strip())
        for w in caught
        if SYNC_MESSAGE in str(w.message)
    ]


def is_loss_read(site: SyncSite) -> bool:
    return site.path.endswith(("callbacks/step_sync.py", "callbacks/loss_monitor.py"))


def sync_rows(results: dict[str, list[list[SyncSite]]]) -> list[tuple]:
    return [
        (label, " ".join(str(len(s)) for s in per_step) or "-", f"{median(len(s) for s in per_step):g}")
        for label, per_step in results.items()
    ]


def sync_verdicts(quiet: list[list[SyncSite]], printing: list[list[SyncSite]]) -> list[str]:
    """The quiet run's syncs per step (target 0), and whether the printing run has exactly one more per step,
    from LossMonitor/StepSync (the counter works)."""
    quiet_counts, printing_counts = [len(s) for s in quiet], [len(s) for s in printing]
    if not quiet_counts:
        target = "syncs: NOT MEASURED (no step was counted)"
    elif not any(quiet_counts):
        target = f"syncs: OK, 0 host syncs per steady step over {len(quiet_counts)} steps (target 0)"
    else:
        top = Counter(site for step in quiet for site in step).most_common(3)
        where = ", ".join(f"{site.path}:{site.line}" for site, _ in top)
        target = f"syncs: MISSED, {median(quiet_counts):g} host syncs per steady step (target 0), from {where}"
    extra = median(printing_counts) - median(quiet_counts)
    loss_reads = [sum(is_loss_read(site) for site in step) for step in printing]
    if printing_counts and not any(printing_counts):
        counter = (
            "counter: BROKEN, no sync seen although LossMonitor reads the loss on the host every step "
            "(the sync warnings did not reach Python's warnings)"
        )
    elif extra == 1 and loss_reads and all(n == 1 for n in loss_reads):
        site = next(site for step in printing for site in step if is_loss_read(site))
        counter = f"counter: OK, printing the loss adds 1 sync per step: StepSync's host read, {site.path}:{site.line}"
    else:
        counter = (
            f"counter: UNEXPECTED, printing the loss adds {extra:g} syncs per step "
            f"(per step from LossMonitor/StepSync: {loss_reads})"
        )
    return [target, counter]


# --------------------------------------------------------------------------------- test-only callbacks


class SyncCounter(Callback):
    """Counts host syncs step by step: ``set_sync_debug_mode("warn")`` from the start of step ``first`` to the
    start of step ``first + steps`` (the end of step ``first + steps - 1``, Lightning's work between steps
    included), recording the warnings. Put it first among the callbacks.

    Args:
        first: The first counted step.
        steps: How many steps to count; the fit must run at least ``first + steps + 1`` steps.
    """

    def __init__(self, first: int, steps: int) -> None:
        if first < 0 or steps < 1:
            raise ValueError(f"`SyncCounter(first={first!r}, steps={steps!r})`: first must be >= 0, steps >= 1")
        self.first, self.steps = first, steps
        self.per_step: list[list[SyncSite]] = []
        self._catcher: Optional[warnings.catch_warnings] = None
        self._log: list[warnings.WarningMessage] = []
        self._seen = 0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.first:
            self._catcher = warnings.catch_warnings(record=True)
            self._log = self._catcher.__enter__()
            warnings.simplefilter("always")  # every occurrence, not once per call site
            torch.cuda.set_sync_debug_mode("warn")
        elif self._catcher is not None:
            self.per_step.append(sync_sites(self._log[self._seen :]))
            self._seen = len(self._log)
            if step == self.first + self.steps:
                self.close()

    def close(self) -> None:
        if self._catcher is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catcher.__exit__(None, None, None)
            self._catcher = None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.close()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.close()


class StepProfiler(Callback):
    """``torch.profiler`` (CPU + CUDA, as PhaseTimer's KernelRecorder) from the start of step ``first`` to the start
    of step ``first + steps``.

    Args:
        first: The first profiled step.
        steps: How many steps to profile.
    """

    def __init__(self, first: int, steps: int) -> None:
        self.first, self.steps = first, steps
        self.profile: Optional[profile] = None
        self._active = False

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.first:
            self.profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.profile.__enter__()
            self._active = True
        elif trainer.global_step == self.first + self.steps:
            self.stop()

    def stop(self) -> None:
        if self._active:
            self.profile.__exit__(None, None, None)  # synchronizes: every kernel launched so far is in
            self._active = False

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------ running fits


@contextlib.contextmanager
def in_process_run(quiet: bool = True) -> Iterator[None]:
    """Around an in-process run: Lightning's INFO lines off (they would go to stderr; the report goes to stdout),
    and afterwards the process group destroyed and the environment restored: Lightning writes MASTER_ADDR/PORT,
    LOCAL_RANK, ... into it, which the next run, or a child process, must not inherit."""
    env = dict(os.environ)
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    if quiet:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def fit(callbacks: list[Callback], steps: int, log_dir: Optional[Path] = None) -> None:
    """One in-process single-GPU fit of the notes' model as ``--devices 1`` runs it (LitDDPStrategy, a CSV logger
    that logs every step), with exactly ``callbacks``."""
    with in_process_run():
        torch.manual_seed(0)
        logger = CSVLogger(log_dir, name="gpu_check", version=0) if log_dir else False
        trainer = Trainer(accelerator="gpu", devices=1, strategy=LitDDPStrategy(), max_steps=steps,
                          callbacks=callbacks, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        trainer.fit(LinearRegression(dim=DIM), FixedBatchDataModule(dim=DIM, batch_size=BATCH))


def quiet_loss() -> LossMonitor:
    return LossMonitor(every_n_steps=0, check_finite=False)


class ProfiledFit(NamedTuple):
    phases: dict  # PhaseTimer's phases.json
    profile: Optional[profile]  # the torch.profiler.profile PhaseTimer's KernelRecorder ran


@functools.cache
def profiled_fit(steps: int) -> ProfiledFit:
    """A fit with PhaseTimer(kernel_steps=3) + CommMonitor, keeping the very profiler PhaseTimer ran: its
    ``KernelRecorder`` makes it with ``lit_ddp.callbacks.kernels.profile``, wrapped here to keep a reference.
    Shared by the busy and events sections."""
    kept: list[profile] = []

    def keeping_profile(*args: Any, **kwargs: Any) -> profile:
        kept.append(profile(*args, **kwargs))
        return kept[-1]

    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(kernels, "profile", keeping_profile):
        fit([PhaseTimer(print_steps=0, kernel_steps=KERNEL_STEPS), CommMonitor(), quiet_loss()], steps, Path(tmp))
        phases = json.loads((Path(tmp) / "gpu_check" / "version_0" / "phases.json").read_text())
    return ProfiledFit(phases, kept[0] if kept else None)


def device_total_ms(prof: profile) -> float:
    """torch.profiler's own total GPU time, the "Self CUDA time total" of ``key_averages().table()``: the device
    rows' ``self_device_time_total`` summed, GPU user annotations left out (us -> ms)."""
    device_rows = [r for r in prof.key_averages() if r.device_type == DeviceType.CUDA]
    return sum(r.self_device_time_total for r in device_rows if not getattr(r, "is_user_annotation", False)) / 1e3


def independent_profile_ms() -> float:
    """Device total (ms) of our own profiler over steps 2-4 of a fit like ``profiled_fit``'s, but with PhaseTimer
    not profiling (so no marker kernels)."""
    profiler = StepProfiler(FIRST_PROFILED_STEP, KERNEL_STEPS)
    callbacks = [profiler, PhaseTimer(print_steps=0, kernel_steps=0), CommMonitor(), quiet_loss()]
    with tempfile.TemporaryDirectory() as tmp:
        fit(callbacks, FIRST_PROFILED_STEP + KERNEL_STEPS + 1, Path(tmp))
    return device_total_ms(profiler.profile) if profiler.profile is not None else math.nan


def synchronized_phases(steps: int, warmup: int, device: Optional[torch.device] = None) -> list[float]:
    """Median forward, backward and update ms of a plain loop on the same model, batch and optimizer (the module's
    own ``configure_optimizers``; DDP over a 1-rank NCCL group, as in the fit), each phase between two
    ``torch.cuda.synchronize()`` + ``perf_counter``. ``zero_grad`` is outside the phases, as in PhaseTimer.
    (``device`` cpu, with gloo and no synchronize, only exercises this code without a GPU.)"""
    device = device or torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    with in_process_run():
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.manual_seed(0)
        module = LinearRegression(dim=DIM).to(device)
        model = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
        optimizer = module.configure_optimizers()
        x, y = (t.to(device) for t in shard(DIM, BATCH, seed=0, rank=0, world_size=1))
        times = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            loss = ((model(x) - y) ** 2).mean()
            sync()
            t1 = time.perf_counter()
            optimizer.zero_grad()
            sync()
            t2 = time.perf_counter()
            loss.backward()
            sync()
            t3 = time.perf_counter()
            optimizer.step()
            sync()
            t4 = time.perf_counter()
            times.append(((t1 - t0) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3))
        del model, optimizer  # DDP's reducer goes while its process group is alive
    return [median(t[i] for t in times[warmup:]) for i in range(3)]


def child_env() -> dict[str, str]:
    """The environment the check started with (no Lightning variables), with the repository importable."""
    return {**CLEAN_ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), CLEAN_ENV.get("PYTHONPATH")) if p)}


def reference_step_ms(configs: list[tuple[int, int, bool]], steps: int, warmup: int, timeout_s: int) -> dict:
    """Steady ms per step of ``python -m lit_ddp.reference --dim D --batch-size B [--fused]`` for each config, all
    in one child process (``REFERENCE_DRIVER``), from the step marks each writes with ``--timings``."""
    with tempfile.TemporaryDirectory() as tmp:
        dirs, argvs = {}, []
        for dim, batch, fused in configs:
            dirs[(dim, batch, fused)] = out = Path(tmp, f"d{dim}_b{batch}_{'fused' if fused else 'default'}")
            out.mkdir()
            argv = ["--dim", str(dim), "--batch-size", str(batch), "--steps", str(steps), "--timings", str(out)]
            argvs.append(argv + (["--fused"] if fused else []))
        cmd = [sys.executable, "-c", REFERENCE_DRIVER, json.dumps(argvs)]
        result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"the plain loop failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        return {config: steady_step_ms(read_step_starts(out), warmup) for config, out in dirs.items()}


@contextlib.contextmanager
def working_dir(path: Path) -> Iterator[None]:
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def port_step_ms(dim: int, batch: int, fast: bool, steps: int, warmup: int) -> float:
    """Steady ms per step of ``python -m lit_ddp.fit --devices 1 [--config configs/fast.yaml]``, run in this
    process through ``cli_main`` (the command's own code, without its ~13 s start-up), timed by StepClock as in
    ``benchmarks/step_time.py``; its output (the Step lines) goes to a buffer."""
    from lit_ddp.fit import cli_main  # only this section runs the CLI

    config = ["--config", str(ROOT / "configs" / "fast.yaml")] if fast else []
    with tempfile.TemporaryDirectory() as tmp, working_dir(Path(tmp)), in_process_run(quiet=False):
        args = [*config, "--devices", "1", "--model.dim", str(dim), "--data.batch_size", str(batch),
                "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(Path(tmp, "runs")),
                f"--trainer.callbacks+={STEP_CLOCK}", f"--trainer.callbacks.out_dir={tmp}"]  # fmt: skip
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):  # console.setup points the loggers at this stdout
                cli_main(args)
        except Exception as err:
            tail = out.getvalue()[-2000:]
            raise RuntimeError(f"python -m lit_ddp.fit {' '.join(args)} failed: {err!r}\n{tail}") from err
        return steady_step_ms(read_step_starts(Path(tmp)), warmup)


# ---------------------------------------------------------------------------------------------- sections


def header() -> Section:
    """torch, lightning, CUDA, cuDNN, NCCL, driver, GPU."""
    props = torch.cuda.get_device_properties(0)
    nccl = "-"
    with contextlib.suppress(Exception):
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    get_api = getattr(torch._C, "_cuda_getDriverVersion", None)  # private: the driver's CUDA version, e.g. 13000
    api = get_api() if get_api else 0
    supports = f" (supports CUDA {api // 1000}.{api % 1000 // 10})" if api else ""
    return Section(
        f"gpu_check, {datetime.now():%Y-%m-%d %H:%M}, {socket.gethostname()}",
        [
            f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
            f"NCCL {nccl}), lightning {lightning.__version__}, Python {platform.python_version()}",
            f"{torch.cuda.device_count()} GPU(s) visible; device 0: {props.name}, sm_{props.major}{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs",
            f"driver {driver_version()}{supports}; fp32 matmul precision "
            f"{torch.get_float32_matmul_precision()!r} ('highest': no TF32)",
        ],
    )


def driver_version() -> str:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"
    return (result.stdout.strip().splitlines() or ["unknown"])[0]


def tests_section(budget: Budget) -> Section:
    """The GPU tests, in a child process with the environment the check started with. ``-rA`` lists every test
    that ran and every skip with its reason: on a CUDA machine a "needs a CUDA GPU" skip is a broken condition,
    a "needs 2 GPUs" skip on one GPU is not."""
    section = Section("1. GPU tests")
    args = ["-q", "-p", "no:cacheprovider", "-m", "slow or not slow", "-k", "cuda or gpu", "-rA"]
    section.lines.append("pytest " + " ".join(a if " " not in a else repr(a) for a in args))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=budget.tests_timeout_s)
    except subprocess.TimeoutExpired:
        # SIGINT first: pytest then runs the tests' clean-up, which kills the `python -m lit_ddp.fit` runs they
        # started in sessions of their own (they would hold the GPU through the next sections).
        proc.send_signal(signal.SIGINT)
        try:
            stdout, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
        section.lines += [f"TIMED OUT after {budget.tests_timeout_s} s; output so far:", *stdout.splitlines()[-30:]]
        section.verdicts.append(f"tests: TIMED OUT after {budget.tests_timeout_s} s")
        return section
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    summary = parse_pytest(result.stdout)
    c = summary.counts
    section.lines.append(
        f"exit {result.returncode} after {time.perf_counter() - start:.0f} s; {summary.ran} test(s) ran: "
        f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped, "
        f"{c.get('errors', 0)} errors ({c.get('deselected', 0)} deselected)"
    )
    section.lines += [f"  {outcome:<7} {what}" for outcome, what in summary.outcomes]
    bad = result.returncode != 0 or c.get("failed", 0) or c.get("errors", 0)
    if bad:
        section.lines += ["output tail:", *(result.stdout + result.stderr).strip().splitlines()[-40:]]
    if summary.ran == 0:
        section.verdicts.append(f"tests: NOTHING RAN ({summary.line or 'no pytest summary line'})")
    elif bad:
        section.verdicts.append(f"tests: FAILED ({summary.line}, exit {result.returncode})")
    else:
        section.verdicts.append(f"tests: OK, {c.get('passed', 0)} passed ({summary.line})")
    cuda_skips = [what for outcome, what in summary.outcomes if outcome == "SKIPPED" and "needs a CUDA GPU" in what]
    if cuda_skips:
        section.verdicts.append(f"tests: {len(cuda_skips)} test(s) skipped for want of CUDA on a CUDA machine")
    return section


def syncs_section(budget: Budget) -> Section:
    """Host syncs per steady step, and where they come from.

    ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call torch knows of (a blocking
    copy to the host: ``.item()``, ``.cpu()``, ``.tolist()``; a stream or device synchronize) emit a
    UserWarning, attributed to the Python line that called into torch. ``SyncCounter`` turns it on for steps
    11..20 only (after warm-up, and after DDP's first 10 iterations, which wait for the previous step's events
    at forward start for its runtime stats, unseen by the debug mode: ``Budget.sync_first``) and sorts the
    warnings by step. Limits: the mode is process-wide, but a warning reaches Python only on a thread that runs
    Python; autograd collects its worker threads' warnings and replays them on the calling thread when backward
    ends, so a sync inside backward (DDP's hooks) is counted but shows at the ``backward()`` call, not where it
    happened; torch.distributed's own operations are not covered (torch's docs). Two runs: the tool's per-step
    work off (PhaseTimer + CommMonitor on, LossMonitor quiet, SyncCheck at the end only), target 0; and the same
    with LossMonitor printing every step, whose host read of the loss (StepSync's ``.cpu()``) must show as
    exactly 1 more per step: proof that the counter sees syncs at all.
    """
    last = budget.sync_first + budget.sync_steps - 1
    section = Section(f"2. Host syncs per steady step (steps {budget.sync_first}..{last}, dim {DIM}, batch {BATCH})")
    runs = {"PhaseTimer + CommMonitor, loss printing off": 0, "the same, LossMonitor printing every step": 1}
    results: dict[str, list[list[SyncSite]]] = {}
    for label, every in runs.items():
        counter = SyncCounter(budget.sync_first, budget.sync_steps)
        callbacks = [counter, PhaseTimer(print_steps=0, kernel_steps=0), CommMonitor(),
                     LossMonitor(every_n_steps=every, check_finite=False), SyncCheck(every_n_steps=0)]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            try:
                fit(callbacks, budget.sync_first + budget.sync_steps + 1, Path(tmp))
            finally:
                counter.close()
        results[label] = counter.per_step
    section.lines += table(("run", "syncs per step", "median"), sync_rows(results))
    for label, per_step in results.items():
        sites = Counter(site for step in per_step for site in step)
        if sites:
            section.lines.append(f"call sites, {label} (count over {len(per_step)} steps, file:line, code):")
            section.lines += [f"  {n:>4}  {site.path}:{site.line}  {site.code}" for site, n in sites.most_common()]
    section.lines.append(
        "(a sync inside backward is replayed by autograd at the backward() call; torch.distributed's own syncs "
        "are not covered by set_sync_debug_mode)"
    )
    section.verdicts += sync_verdicts(*results.values())
    return section


def busy_rows(timer_ms: float, steps: int, measures: list[tuple[str, float]]) -> list[tuple]:
    first = (f"PhaseTimer busy 'step' column, summed over its {steps} profiled steps", fmt_ms(timer_ms), "")
    return [first, *((name, fmt_ms(value), fmt_ratio(ratio(timer_ms, value))) for name, value in measures)]


def busy_section(budget: Budget) -> Section:
    """PhaseTimer's GPU-busy time against torch.profiler's own kernel figures, over the same steps.

    What is comparable: PhaseTimer's busy "step" column is the union of kernel intervals between its "start" marker
    kernels (steps 2-4), its own marker kernels excluded. The reference is computed from the *same* profile
    (PhaseTimer's own profiler, kept by ``profiled_fit``), independently of ``KernelRecorder``: markers found
    through their GPU user annotations (``gpu_activity``), then (a) the union of the other kernels' intervals
    between the first and the last marker: the same quantity, so the two must agree within 5%, else PhaseTimer's
    bookkeeping is wrong; (b) the plain sum of their durations in that window, above the union only where streams
    overlap (NCCL next to compute; on one GPU nothing should); (c) ``key_averages()``'s total device time of the
    whole profile, markers taken out (what the profiler's table prints). GPU user annotations (record_function
    ranges such as ``DistributedDataParallel.forward`` or ``Optimizer.step#Adam.step`` drawn on the GPU timeline,
    gaps included) are not work: when PhaseTimer's figure matches the union *with* them, it counts them as busy. Two
    profilers cannot run at once, so the independent measurement is (d): a second, otherwise identical fit without
    PhaseTimer's markers, with our own profiler from the start of step 2 to the start of step 5. It differs from the
    first by run-to-run variation, so it is reported, not held to 5%.
    """
    first, last = FIRST_PROFILED_STEP, FIRST_PROFILED_STEP + KERNEL_STEPS - 1
    section = Section(f"3. GPU-busy time, PhaseTimer against torch.profiler (steps {first}-{last}, dim {DIM})")
    run = profiled_fit(budget.fit_steps)
    busy = (run.phases.get("busy_ms") or [[]])[0]  # [] when no profiled step was complete
    gpu = gpu_activity(kernels.trace_events(run.profile)) if run.profile is not None else GpuActivity([], [], [])
    if not busy or len(gpu.markers) < 2:
        section.lines.append(f"busy_ms: {len(busy)} steps; marker kernels in its profile: {len(gpu.markers)}")
        section.verdicts.append("busy: NOT MEASURED (no busy_ms from PhaseTimer, or no marker kernels in its profile)")
        return section
    timer_ms = sum(step[4] for step in busy)
    (first_label, w0, _), (last_label, w1, _) = gpu.markers[0], gpu.markers[-1]
    markers_ms = sum(end - start for _, start, end in gpu.markers)
    kernel_union = kernels.union_ms(gpu.kernels, w0, w1)
    with_annotations = kernels.union_ms(gpu.kernels + [(s, e) for _, s, e in gpu.annotations], w0, w1)
    second = independent_profile_ms()
    measures = [
        ("(a) same profile: union of kernel intervals, first to last step marker", kernel_union),
        ("(b) same profile: sum of kernel durations in that window", sum_ms(gpu.kernels, w0, w1)),
        ("(c) same profile: key_averages() device total, markers taken out", device_total_ms(run.profile) - markers_ms),
        ("    (a) with GPU user annotations counted as busy", with_annotations),
        ("(d) second fit, own profiler, no markers: key_averages() device total", second),
    ]
    section.lines += table(("measure", "ms", "PhaseTimer / it"), busy_rows(timer_ms, len(busy), measures))
    section.lines.append(
        f"window: marker {first_label} to marker {last_label}; {len(gpu.kernels)} kernels and copies; "
        f"{len(gpu.markers)} marker kernels ({markers_ms:.3f} ms) left out"
    )
    if gpu.annotations:
        grouped = Counter(MARK_PREFIX + "*" if n.startswith(MARK_PREFIX) else n for n, _, _ in gpu.annotations)
        names = grouped.most_common(6)
        section.lines.append("GPU user annotations in the profile: " + ", ".join(f"{n} x{c}" for n, c in names))
    off = ratio(timer_ms, kernel_union) - 1
    verdict = f"busy: {'OK' if abs(off) <= LIMIT else 'MISSED'}, PhaseTimer {timer_ms:.3f} ms vs the same profile's "
    verdict += f"kernel union {kernel_union:.3f} ms ({fmt_pct(off)}, limit {LIMIT:.0%})"
    if abs(off) > LIMIT and gpu.annotations and abs(ratio(timer_ms, with_annotations) - 1) <= LIMIT:
        verdict += "; it matches the union WITH GPU user annotations: KernelRecorder counts them as kernels"
    section.verdicts.append(verdict)
    section.verdicts.append(
        f"busy: a second fit's own profiler measured {second:.3f} ms ({fmt_pct(ratio(timer_ms, second) - 1)} "
        "from PhaseTimer; run-to-run variation included)"
    )
    return section


def events_rows(events: list[float], busy: list[float], synced: list[float]) -> list[tuple]:
    return [
        (phase, fmt_ms(e), fmt_ms(b), fmt_ms(s), f"{ratio(e, s):.2f}", fmt_share(ratio(b, e)))
        for phase, e, b, s in zip(PHASES, events, busy, synced, strict=True)
    ]


def events_section(budget: Budget) -> Section:
    """CUDA-event phase times against a synchronized measurement of the same region.

    PhaseTimer's event medians come from the steps of ``profiled_fit`` after its profiled ones and after DDP's
    first 10 iterations (step 11 on: ``Budget.sync_first``), its GPU-busy medians from the profiled steps. The
    synchronized loop runs the same model, batch and optimizer with ``torch.cuda.synchronize()`` +
    ``perf_counter`` around forward, backward and update. The two clocks measure different things when the GPU
    waits for Python: an event pair spans everything between its records, idle gaps between tiny host-bound
    kernels included; the synchronized time also holds the launch overhead and the synchronize's own latency.
    Neither is "the GPU's time": the busy column says whether the GPU worked; events - busy is the time the GPU
    idled inside the phase.
    """
    section = Section(f"4. CUDA events against a synchronized loop (dim {DIM}, batch {BATCH}, medians)")
    run = profiled_fit(budget.fit_steps)
    first_steady = max(FIRST_PROFILED_STEP + KERNEL_STEPS, Budget.sync_first)  # after DDP's first 10 iterations
    steady = [row for step, row in zip(run.phases["steps"], run.phases["ms"][0], strict=True) if step >= first_steady]
    busy = (run.phases.get("busy_ms") or [[]])[0]
    events = [median(row[i] for row in steady) for i in range(3)]
    busy_medians = [median(row[i] for row in busy) for i in range(3)]
    synced = synchronized_phases(budget.loop_steps, budget.loop_warmup)
    header = ("phase", "CUDA events ms", "GPU busy ms", "synchronized ms", "events/sync", "busy/events")
    section.lines += table(header, events_rows(events, busy_medians, synced))
    section.lines += [
        f"events: {len(steady)} steady steps (from step {first_steady}); busy: {len(busy)} profiled steps; "
        f"synchronized: {budget.loop_steps - budget.loop_warmup} steps of a plain loop",
        "Events include the GPU's idle gaps between kernels; the synchronized loop includes launch overhead and the",
        "synchronize itself. When the GPU waits for Python the two differ, and busy/events says how much of the phase",
        "the GPU worked (near 100%: GPU-bound; then events and synchronized agree).",
    ]
    per_phase = [
        f"{phase} events {ratio(e, s):.2f}x synchronized, GPU busy {fmt_share(ratio(b, e))}"
        for phase, e, b, s in zip(PHASES, events, busy_medians, synced, strict=True)
    ]
    section.verdicts.append("events: " + "; ".join(per_phase))
    return section


def scaling_section(budget: Budget) -> Section:
    """Per-step time on one GPU, the notes' plain loop against the port, from step timestamps inside the runs.

    The plain loop is ``lit_ddp.reference`` (prints the loss every step, as the notes do: it has no flag to stop
    printing) with torch's default Adam and with ``--fused``; the port runs its default config (``python -m
    lit_ddp.fit --devices 1``) and ``configs/fast.yaml`` (fused Adam, no printing). Both mark the wall clock at the
    top of every step and once at the end (the reference with ``--timings``, after its per-step ``.item()``; the
    port with ``benchmarks.step_clock``, after a ``synchronize()``, so fast.yaml, which reads nothing back, waits
    for the GPU once per step as the plain loop does); a step is the difference of consecutive marks, the first
    steps are dropped, the figure is the median, so start-up is never in it. So that 24 runs
    fit the budget, none pays a start-up of its own: the port runs in this process through ``cli_main`` (the
    command's code), the plain loop in one child process that calls ``lit_ddp.reference.main`` for each
    configuration in turn. Overhead = port default / plain default - 1 and port fast / plain --fused - 1. Rows are
    ordered by the plain loop's step time, so "from ... on" reads down.
    """
    steps, warmup = budget.scaling_steps, budget.scaling_warmup
    section = Section(f"5. ms per step on one GPU, the port against the plain loop ({steps} steps, {warmup} dropped)")
    configs = [(dim, batch, fused) for dim, batch in SCALING_SHAPES for fused in (False, True)]
    plain = reference_step_ms(configs, steps, warmup, budget.reference_timeout_s)
    rows = []
    for dim, batch in SCALING_SHAPES:
        port = port_step_ms(dim, batch, fast=False, steps=steps, warmup=warmup)
        fast = port_step_ms(dim, batch, fast=True, steps=steps, warmup=warmup)
        rows.append(ScalingRow(dim, batch, plain[(dim, batch, False)], plain[(dim, batch, True)], port, fast))
    rows.sort(key=lambda r: r.plain)
    header = ("dim", "batch", "plain loop", "plain --fused", "port default", "port fast", "overhead", "fast overhead")
    section.lines += table(header, scaling_rows(rows))
    section.lines += [
        "overhead: port default vs plain loop; fast overhead: configs/fast.yaml vs plain loop --fused",
        "the plain loop prints the loss every step (lit_ddp.reference has no flag to stop it); fast.yaml does not",
    ]
    for line in (
        under_limit_line(rows, lambda r: r.overhead, "default config vs the plain loop"),
        under_limit_line(rows, lambda r: r.fast_overhead, "configs/fast.yaml vs the plain loop --fused"),
    ):
        section.lines.append(line)
        section.verdicts.append(f"scaling: {line}")
    return section


RUNNERS: dict[str, Callable[[Budget], Section]] = {
    "tests": tests_section,
    "syncs": syncs_section,
    "busy": busy_section,
    "events": events_section,
    "scaling": scaling_section,
}


# ------------------------------------------------------------------------------------------------- main


class Report:
    """Prints each section as it is done and appends it to the output file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def add(self, section: Section, elapsed_s: Optional[float] = None) -> None:
        took = f" ({elapsed_s:.0f} s)" if elapsed_s is not None else ""
        text = "\n".join([f"== {section.title}{took} ==", *section.lines, "", ""])
        print(text, end="", flush=True)
        with self.path.open("a") as f:
            f.write(text)


def section_list(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names or any(n not in SECTIONS for n in names):
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {','.join(SECTIONS)}")
    return names


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the report is also written here")
    parser.add_argument("--sections", type=section_list, default=DEFAULT_SECTIONS,
                        help=f"some of {','.join(SECTIONS)} (default: {','.join(DEFAULT_SECTIONS)})")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer steps (about half)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: error: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "nothing was run", file=sys.stderr)  # fmt: skip
        return 2
    if str(ROOT) not in sys.path:  # the port's CLI imports benchmarks.step_clock.StepClock by name
        sys.path.insert(0, str(ROOT))
    budget = QUICK if args.quick else Budget()
    report = Report(args.out)
    report.add(header())
    verdicts, crashed, start = [], False, time.perf_counter()
    for name in (n for n in SECTIONS if n in args.sections):
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        section_start = time.perf_counter()
        try:
            section = RUNNERS[name](budget)
        except Exception as err:  # one broken section must not hide the others
            lines = traceback.format_exc().rstrip().splitlines()
            first_line = (str(err).splitlines() or [""])[0]
            section = Section(f"{name}: CRASHED", lines, [f"{name}: CRASHED, {type(err).__name__}: {first_line}"], True)
        crashed |= section.crashed
        verdicts += section.verdicts
        report.add(section, time.perf_counter() - section_start)
    report.add(Section(f"Verdicts (total {time.perf_counter() - start:.0f} s)", [f"- {v}" for v in verdicts]))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
