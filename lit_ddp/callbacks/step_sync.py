"""One small collective per step for everything the tool's callbacks need from every rank.

    python -m lit_ddp.fit --devices 2       # the loss (the NaN check), SIGTERM and the sync check ride together

LossMonitor's loss (its NaN check), SyncCheck's fingerprint and every rank's SIGTERM flag go into one float64 row;
one ``all_gather`` (no barrier, started with ``async_op`` and read a step later) gives every rank every row, and
every rank takes the same decisions from the same data. It replaces Lightning's per-step SIGTERM broadcast and
its collectives inside signal handlers (SIGTERM; Slurm's requeue, SIGUSR1): a handler only sets a flag, and every
rank stops or requeues at the same step boundary. The callbacks that need it find or add the one StepSync of a
Trainer (``StepSync.attach``). On CUDA the row is built and read without a host sync: the gathered row is copied
to pinned memory on a side stream and read at the next step's end (``_HostCopy``). docs/callbacks.md; SIGTERM and
the hung rank's exit: docs/failures.md; the profiler and the gather in flight: docs/traces.md.
"""

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from jsonargparse.typing import PositiveInt
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.profilers import PyTorchProfiler
from torch import Tensor
from typing_extensions import override

from lit_ddp import _lightning
from lit_ddp.callbacks.collective_recorder import CollectiveRecorder
from lit_ddp.callbacks.shared import all_gather, exit_cleanly, is_last_step, profiling_callback, say
from lit_ddp.errors import Ending, prog
from lit_ddp.measure.step_marks import OptimizerSteps
from lit_ddp.run import hangs
from lit_ddp.run.even_epochs import EvenEpochs, Uneven


@dataclass
class _Slot:
    values: Tensor  # this rank's values, 1-D float64 on the root device
    on_result: Callable[[Tensor], None]  # called with [world_size, width] float64 on the CPU


@dataclass
class _InFlight:
    """A step's gather, started and not yet read."""

    gathered: Tensor  # [world_size, 2 + widths]: the SIGTERM and requeue flags, then each slot's values
    work: Optional[dist.Work]
    slots: dict[str, _Slot]
    copied: Any = None  # CUDA: the event after ``gathered``'s copy to pinned host memory (``_HostCopy``)


class _HostCopy:
    """CUDA: brings a gathered row to the host without a host sync in the step. ``torch.tensor(..., device=cuda)``
    copies with ``non_blocking=False`` (a ``memcpy_and_sync``), and ``gathered.cpu()`` a step later waits behind that
    step's backward and update on the current stream: either way the host could never run ahead of the GPU. Here
    the flags are filled on the device (no copy), a side stream waits for the collective (``Work.wait()`` makes the
    *current* stream wait; NCCL's returns at once) and copies the row into pinned memory with ``non_blocking``, and
    an event recorded after it is waited for a step later, when it has long completed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def flags(self, sigterm: bool, requeue: bool) -> Tensor:
        row = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, flag in enumerate((sigterm, requeue)):
            if flag:
                row[i].fill_(1.0)  # a fill kernel with the value as its argument: no host-to-device copy
        return row

    def start(self, gathered: Tensor, work: Optional[dist.Work]) -> tuple[Tensor, Any]:
        """Queues the copy of ``gathered`` (once ``work`` is done) to pinned host memory; the host tensor and the
        event that says it is there."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # world size 1: the row's own kernels
        with torch.cuda.stream(self.stream):
            if work is not None:
                work.wait()  # the side stream waits for the collective's stream; the host does not
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=self.device.type == "cuda")
            host.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        gathered.record_stream(self.stream)  # the allocator must not hand its memory out before the copy ran
        return host, copied

    @staticmethod
    def wait(copied: Any) -> None:
        copied.synchronize()  # a step later: long completed, so this returns at once


class StepSync(Callback):
    """Carries per-step values of every rank to every rank in one ``all_gather``, and SIGTERM with them.

    Args:
        sigterm_every_n_steps: Check for SIGTERM at least every n steps (a step that gathers anyway always
            checks). Between checks a step that nobody else needs has no collective and no host read.
        uneven: Ranks whose data ends at different batches of an epoch: ``stop`` ends every rank's epoch at the
            last batch every rank has and says so; ``error`` raises ``UnevenDataError`` on every rank, before any
            runs out (``lit_ddp.run.even_epochs``).
    """

    # Rank 0's, sent back to a launching parent (ddp_fork/ddp_spawn): a SIGTERM that reached a rank but not the
    # parent ends the run there too (``lit_ddp._lightning.CarryBackLauncher``).
    carried_back = ("ending",)

    def __init__(self, sigterm_every_n_steps: PositiveInt = 10, uneven: Uneven = "stop") -> None:
        if sigterm_every_n_steps < 1:
            raise ValueError(f"`StepSync(sigterm_every_n_steps={sigterm_every_n_steps!r})` must be >= 1")
        if uneven not in ("stop", "error"):
            raise ValueError(f"`StepSync(uneven={uneven!r})` must be 'stop' or 'error'")
        self.sigterm_every_n_steps = sigterm_every_n_steps
        self.uneven = uneven
        self._even: Optional[EvenEpochs] = None
        self._slots: dict[str, _Slot] = {}
        self._in_flight: Optional[_InFlight] = None
        self._host_copy: Optional[_HostCopy] = None  # made in setup, on CUDA
        self._profiles: Optional[list] = None  # [the Trainer's ProfilesSteps callback or None], found at the first step
        self._no_flags = torch.zeros(2, dtype=torch.float64)  # the usual CPU flags: no tensor made per step
        self._sigterm = False
        self.ending = Ending.FINISHED  # how this fit ended, when it did not raise
        self.collectives = 0  # how many per-step collectives ran (for tests and benchmarks)
        self._steps = OptimizerSteps()
        self._alive_at = time.monotonic()  # the last step boundary (or validation batch) this rank reached

    @staticmethod
    def attach(trainer: Trainer, caller: Callback, stage: str = "fit") -> Optional["StepSync"]:
        """The Trainer's StepSync, added to its callbacks if it has none; call from ``caller``'s ``setup`` with its
        ``stage``: outside ``fit`` (validate, test, predict) there is no training step to sync, and None.

        The StepSync's batch end must come after the callers', which ``put`` into it there: one listed before
        ``caller`` is moved right after it (so it stays before callbacks that come later, a checkpoint say).
        """
        if stage != "fit":
            return None
        callbacks = trainer.callbacks  # Lightning iterates trainer.callbacks afresh for every hook
        sync = next((c for c in callbacks if isinstance(c, StepSync)), None)
        if sync is None:
            sync = StepSync()
            callbacks.append(sync)
            sync.setup(trainer, trainer.lightning_module, "fit")
        elif caller in callbacks and callbacks.index(sync) < callbacks.index(caller):
            callbacks.remove(sync)
            callbacks.insert(callbacks.index(caller) + 1, sync)
        return sync

    def put(self, key: str, values: list[float] | Tensor, on_result: Callable[[Tensor], None]) -> None:
        """Adds this rank's ``values`` for this step; after the step's collective (in this callback's
        ``on_train_batch_end``, after those of the callbacks before it) ``on_result`` gets every rank's values,
        ``[world_size, len(values)]``, on the CPU: at the end of the next step, or of this one if it is the
        last. Every rank must put the same keys and widths."""
        if isinstance(values, Tensor):
            row = values.detach().reshape(-1).to(device=self._device, dtype=torch.float64)
        else:  # from the host: pinned, so that the copy to a GPU does not wait for it
            row = torch.tensor(values, dtype=torch.float64)
            if self._device.type == "cuda":
                row = row.pin_memory().to(self._device, non_blocking=True)
        self._slots[key] = _Slot(row, on_result)

    @staticmethod
    def ending_of(trainer: Trainer) -> Ending:
        """How the Trainer's StepSync saw training end (``FINISHED`` when it has none)."""
        return next((c.ending for c in trainer.callbacks if isinstance(c, StepSync)), Ending.FINISHED)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Idempotent: `attach` calls it for a StepSync it adds, and Lightning then calls it again.
        if stage != "fit":
            return
        exit_cleanly(trainer)
        CollectiveRecorder.attach(trainer, before=self)  # its mark at a step's end comes before the gather
        self._device = trainer.strategy.root_device
        self._host_copy = _HostCopy(self._device) if self._device.type == "cuda" else None
        self._sigterm, self.ending, self._in_flight, self._profiles = False, Ending.FINISHED, None, None
        self._requeue = self._requeued = False

        def note_requeue(signum, frame) -> None:
            self._requeue = True

        # Lightning's own handler saves a checkpoint and waits in a barrier inside the signal handler, wherever
        # each rank is: a rank blocked in a collective never gets there, and the job hangs to its timeout. The
        # flag rides in the step's row instead; every rank runs Lightning's handler at the same step boundary.
        self._requeue_now = _lightning.replace_requeue_handler(trainer, note_requeue)

        # A collective waits this long for a missing rank (LitDDPStrategy's timeout_s, else torch's default).
        hung_after_s = getattr(trainer.strategy, "timeout_s", None) or dist.default_pg_timeout.total_seconds()

        def notify(signum, frame) -> None:
            stuck = time.monotonic() - self._alive_at
            if stuck > hung_after_s / 2:  # hung: no step boundary will ever read the flag
                where = hangs.hung_at(frame)
                state = "failed, reporting" if where is None else f"hung{f' at {where}' if where else ''}"
                print(f"{prog()}: rank {trainer.global_rank}: SIGTERM after {stuck:.0f} s without a step boundary "
                      f"({state}): exiting at once", file=sys.stderr, flush=True)  # fmt: skip
                sys.stdout.flush()
                os._exit(143)
            launcher = trainer.strategy.launcher
            if not self._sigterm and launcher is not None:
                launcher.kill(signum)  # the ranks this one launched get it too
            self._sigterm = True

        _lightning.replace_sigterm_notifier(trainer, notify)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._alive_at = time.monotonic()
        if trainer.world_size > 1:
            _lightning.disable_sigterm_broadcast(trainer)
            self._even = EvenEpochs(self.uneven, trainer.accumulate_grad_batches, lambda text: say(trainer, text))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._steps.batch_start(trainer)
        if self._even is not None:
            self._even.batch_start(trainer)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._alive_at = time.monotonic()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self._alive_at = time.monotonic()
        if not self._steps.ended(trainer):  # a micro-batch
            return
        self._finish(trainer)  # the previous step's gather: long done by now
        if self._even is not None:
            self._even.step_end(trainer, self.put)
        if trainer.world_size == 1:  # nobody to agree with: this rank's own flags decide, no tensor needed
            if self._slots:
                self._send(trainer)
                self._finish(trainer)
            self._decide(trainer, self._sigterm, self._requeue)
            return
        # Every rank must take the same branch here: it depends on the slots (every rank puts the same keys) and
        # the step, never on a signal flag, which each rank's handler sets at its own moment (a rank gathering
        # alone pairs its all-gather with another rank's bucket all-reduce). A flag waits for the next row.
        if self._slots or trainer.global_step % self.sigterm_every_n_steps == 0:
            self._send(trainer)
        if is_last_step(trainer, batch_idx) or trainer.should_stop or self._profiler_toggles_next(trainer):
            self._finish(trainer)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A NaN or a sync error raises before a checkpoint holding its step is written, wherever the checkpoint
        # callback is listed (before this one, this step's values are not even sent yet).
        self._finish(trainer)
        if self._slots:
            self._send(trainer)
            self._finish(trainer)

    def _send(self, trainer: Trainer) -> None:
        """Starts the gather of this step's row: the SIGTERM and requeue flags, then every slot's values."""
        slots, self._slots = self._slots, {}
        copy = self._host_copy
        if copy is not None:
            flags = copy.flags(self._sigterm, self._requeue)
        else:
            sigterm, requeue = self._sigterm, self._requeue
            flags = torch.tensor([float(sigterm), float(requeue)], dtype=torch.float64) if sigterm or requeue else \
                self._no_flags  # fmt: skip
        row = torch.cat([flags, *(slot.values for slot in slots.values())])
        work = None
        if trainer.world_size == 1:  # nothing to exchange: every value is already here
            gathered = row.view(1, -1)
        else:
            gathered, work = all_gather(row, trainer.world_size, async_op=True)
            self.collectives += 1
        if copy is None:
            self._in_flight = _InFlight(gathered, work, slots)
            return
        host, copied = copy.start(gathered, work)
        self._in_flight = _InFlight(host, None, slots, copied)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer)  # training stopped early (a SIGTERM, another callback): the last step's results

    def _finish(self, trainer: Trainer) -> None:
        """Waits for the gather in flight, if any, and hands each caller its columns; every rank takes the same
        decisions from the same rows."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        if flight.work is not None:
            flight.work.wait()
        if flight.copied is not None:
            _HostCopy.wait(flight.copied)
        gathered = flight.gathered  # on the host now
        start = 2
        for slot in flight.slots.values():
            width = slot.values.numel()
            slot.on_result(gathered[:, start : start + width])
            start += width
        flags = gathered[:, :2]
        if flags.any():  # one test for the usual step, where no rank has a signal
            self._decide(trainer, bool(flags[:, 0].any()), bool(flags[:, 1].any()))

    def _decide(self, trainer: Trainer, sigterm: bool, requeue: bool) -> None:
        """What every rank does with the flags of every rank (the same on each, at the same step)."""
        if requeue and not self._requeued:  # Slurm's requeue signal reached a rank
            self._requeued = True
            self._requeue_now(signal.SIGUSR1, None)  # every rank, here: the checkpoint, then rank 0 requeues
        if sigterm:
            self.ending = Ending.SIGTERM
            trainer.should_stop = True

    def _profiler_toggles_next(self, trainer: Trainer) -> bool:
        """Whether a torch profiler may start or stop before this step's gather would be read. Gloo ends a
        collective's profiler range on its own worker thread when the collective completes; a profiler stopped
        meanwhile (its trace finalized on the main thread) raced it and crashed the rank in about one run of five
        (``configs/mini_train_profile.yaml``, issue 40). So no gather of this callback is in flight across
        PhaseTimer's start or stop of its profiler (at the start of its first profiled step and of the step after
        its last), nor at all under Lightning's PyTorchProfiler, whose schedule starts and stops inside steps."""
        if isinstance(trainer.profiler, PyTorchProfiler):
            return True
        if self._profiles is None:  # once a fit: a Protocol's isinstance over every callback costs ~0.1 ms a step
            self._profiles = [profiling_callback(trainer)]
        found = self._profiles[0]
        profiled = found.profiled_steps if found is not None else range(0)
        return len(profiled) > 0 and trainer.global_step in (profiled.start, profiled.stop)
