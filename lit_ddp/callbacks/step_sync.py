"""One small collective per step for everything the tool's callbacks need from every rank.

    python -m lit_ddp.fit --devices 2       # the loss, the NaN flag, SIGTERM and the sync check ride together

LossMonitor's loss and NaN flag, SyncCheck's fingerprint and every rank's SIGTERM flag go into one float64 row;
one ``all_gather`` (no barrier, started with ``async_op`` and read a step later) gives every rank every row, and
every rank takes the same decisions from the same data. It replaces Lightning's per-step SIGTERM broadcast and
its collectives inside signal handlers (SIGTERM; Slurm's requeue, SIGUSR1): a handler only sets a flag, and every
rank stops or requeues at the same step boundary. The callbacks that need it find or add the one StepSync of a
Trainer (``StepSync.attach``). docs/callbacks.md; SIGTERM and the hung rank's exit: docs/failures.md.
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
from torch import Tensor
from typing_extensions import override

from lit_ddp import _lightning
from lit_ddp.callbacks.collective_recorder import CollectiveRecorder
from lit_ddp.callbacks.shared import all_gather, exit_cleanly, is_last_step, say
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

    gathered: Tensor  # [world_size, 1 + widths]: the SIGTERM flag, then each slot's values
    work: Optional[dist.Work]
    slots: dict[str, _Slot]


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
        device = self._device
        row = values.detach().reshape(-1) if isinstance(values, Tensor) else torch.tensor(values)
        self._slots[key] = _Slot(row.to(device=device, dtype=torch.float64), on_result)

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
        self._sigterm, self.ending, self._in_flight = False, Ending.FINISHED, None
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
        if self._slots or self._sigterm or self._requeue or trainer.global_step % self.sigterm_every_n_steps == 0:
            self._send(trainer)
        if trainer.world_size == 1 or is_last_step(trainer, batch_idx):
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
        flags = torch.tensor([float(self._sigterm), float(self._requeue)], dtype=torch.float64, device=self._device)
        row = torch.cat([flags, *(slot.values for slot in slots.values())])
        if trainer.world_size == 1:  # nothing to exchange: every value is already here
            self._in_flight = _InFlight(row.view(1, -1), None, slots)
            return
        gathered, work = all_gather(row, trainer.world_size, async_op=True)
        self._in_flight = _InFlight(gathered, work, slots)
        self.collectives += 1

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
        gathered = flight.gathered.cpu()  # the host read
        start = 2
        for slot in flight.slots.values():
            width = slot.values.numel()
            slot.on_result(gathered[:, start : start + width])
            start += width
        if gathered[:, 1].any() and not self._requeued:  # Slurm's requeue signal reached a rank
            self._requeued = True
            self._requeue_now(signal.SIGUSR1, None)  # every rank, here: the checkpoint, then rank 0 requeues
        if gathered[:, 0].any():  # the same decision on every rank, at the same step
            self.ending = Ending.SIGTERM
            trainer.should_stop = True
