"""What the GPU check's sections share: its budget, a section of its report, in-process one-GPU fits, and a
callback that acts over a window of steps.

    from benchmarks.gpu_fits import Budget, Section, fit, profiled_fit

The fits train the notes' model (``LinearRegression``: one ``Linear(dim, dim)``, Adam) on
``FixedBatchDataModule``'s batch with ``LitDDPStrategy`` on one GPU (DDP over a 1-rank NCCL group, as
``--devices 1`` runs it). In-process runs destroy their process group and restore the environment after
themselves. (Apart from ``benchmarks/common.py`` because that one must import no tool code.)
"""

import contextlib
import functools
import gzip
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional
from unittest import mock

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.profiler import profile
from typing_extensions import override

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer
from lit_ddp.measure import profiling
from lit_ddp.records.schema import PhaseRecord, load_run
from lit_ddp.run.strategy import LitDDPStrategy

DIM, BATCH = 4096, 32  # the profile config's model (configs/mini_train_profile.yaml), the notes' batch
KERNEL_STEPS = 3  # PhaseTimer's default number of profiled steps on CUDA
LIMIT = 0.05  # "agree" and "overhead" threshold
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lit_ddp")
# The environment the check started with, before any in-process fit wrote Lightning's variables into it.
CLEAN_ENV: dict[str, str] = dict(os.environ)


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
    reference_timeout_s: int = 180


QUICK = Budget(sync_steps=5, fit_steps=20, loop_steps=16, scaling_steps=20, scaling_warmup=4)


@dataclass
class Section:
    """One part of the report: its lines, and one-line verdicts repeated at the end."""

    title: str
    lines: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    crashed: bool = False


class StepWindow(Callback):
    """Acts from the start of step ``first`` to the start of step ``first + steps`` (the end of step
    ``first + steps - 1``, Lightning's work between steps included): ``begin`` at the first, ``step_done`` at the
    start of each later step inside, ``end`` at the last, or as soon as training ends or fails.

    Args:
        first: The first step inside.
        steps: How many steps; the fit must run at least ``first + steps + 1`` steps for all of them to count.
    """

    def __init__(self, first: int, steps: int) -> None:
        if first < 0 or steps < 1:
            raise ValueError(f"`{type(self).__name__}(first={first!r}, steps={steps!r})`: first must be >= 0, "
                             "steps >= 1")  # fmt: skip
        self.first, self.steps = first, steps
        self.active = False

    def begin(self) -> None: ...

    def step_done(self) -> None: ...

    def end(self) -> None: ...

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.first:
            self.active = True
            self.begin()
        elif self.active:
            self.step_done()
            if trainer.global_step == self.first + self.steps:
                self.close()

    def close(self) -> None:
        if self.active:
            self.active = False
            self.end()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.close()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.close()


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


def fit(callbacks: list[Callback], steps: int, log_dir: Path) -> None:
    """One in-process single-GPU fit of the notes' model as ``--devices 1`` runs it (LitDDPStrategy, a CSV logger
    that logs every step, to ``log_dir/gpu_check/version_0``), with exactly ``callbacks``."""
    with in_process_run():
        torch.manual_seed(0)
        logger = CSVLogger(log_dir, name="gpu_check", version=0)
        trainer = Trainer(accelerator="gpu", devices=1, strategy=LitDDPStrategy(), max_steps=steps,
                          callbacks=callbacks, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
        trainer.fit(LinearRegression(dim=DIM), FixedBatchDataModule(dim=DIM, batch_size=BATCH))


def quiet_loss() -> LossMonitor:
    return LossMonitor(every_n_steps=0, check_finite=False)


class ProfiledFit(NamedTuple):
    phases: PhaseRecord  # what PhaseTimer wrote to phases.json
    profile: Optional[profile]  # the torch.profiler.profile PhaseTimer's TraceRecorder ran
    trace: Optional[dict[str, Any]]  # the Chrome trace it wrote (rank 0's, as JSON); None without one


@functools.cache
def profiled_fit(steps: int) -> ProfiledFit:
    """A fit with PhaseTimer(kernel_steps=3) + CommMonitor, keeping the very profiler PhaseTimer ran (its
    ``TraceRecorder`` makes it with ``lit_ddp.measure.profiling.profile``, wrapped here to keep a reference) and
    the trace it wrote. Shared by the busy and events sections."""
    kept: list[profile] = []

    def keeping_profile(*args: Any, **kwargs: Any) -> profile:
        kept.append(profile(*args, **kwargs))
        return kept[-1]

    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(profiling, "profile", keeping_profile):
        fit([PhaseTimer(print_steps=0, kernel_steps=KERNEL_STEPS), CommMonitor(), quiet_loss()], steps, Path(tmp))
        phases, _ = load_run(Path(tmp) / "gpu_check" / "version_0")
        written = Path(tmp) / "gpu_check" / "version_0" / "traces" / "rank0.pt.trace.json.gz"
        trace = json.loads(gzip.decompress(written.read_bytes())) if written.is_file() else None
    if phases is None:
        raise RuntimeError("PhaseTimer wrote no phases.json")
    return ProfiledFit(phases, kept[0] if kept else None, trace)
