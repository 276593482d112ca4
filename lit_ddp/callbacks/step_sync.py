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

from lit_ddp import _lightning, _torch
from lit_ddp.callbacks.collective_recorder import CollectiveRecorder
from lit_ddp.callbacks.shared import exit_cleanly, is_last_step, profiling_callback, say
from lit_ddp.errors import Ending, prog
from lit_ddp.measure.step_marks import OptimizerSteps
from lit_ddp.run import hangs
from lit_ddp.run.even_epochs import EvenEpochs, Uneven
from lit_ddp.run.lean import LeanCallback


@dataclass
class _Slot:
    """A caller's columns in the row."""

    offset: int
    width: int


class _Rows:
    """The preallocated buffers of one step's gather, for one layout of the row (the SIGTERM and requeue flags,
    then each slot's columns): the row, every rank's rows once gathered, and, on CUDA, their pinned copy on the
    host; with a view per slot into each, made once. Two take turns (``StepSync._pair``): a step's callers write
    their values while the gather of the step before may still be in flight from the other. A caller's columns
    are valid during its ``on_result`` call only: the buffers are used again two steps later."""

    def __init__(self, slots: dict[str, _Slot], world_size: int, device: torch.device, host_copy: bool) -> None:
        width = 2 + sum(slot.width for slot in slots.values())
        self.row = torch.zeros(width, dtype=torch.float64, device=device)
        if world_size == 1:  # nothing to exchange: the row is every rank's row
            self.gathered = self.row.view(1, width)
        else:
            self.gathered = torch.zeros(world_size, width, dtype=torch.float64, device=device)
        self.flat = self.gathered.view(-1)  # what the collective fills
        # What the callers read: the gathered rows on the host (on CUDA a pinned copy, made on a side stream).
        self.host = self.gathered
        if host_copy:
            self.host = torch.zeros(world_size, width, dtype=torch.float64, pin_memory=device.type == "cuda")
        self.flags, self.host_flags = self.row[:2], self.host[:, :2]
        self.values = {key: self.row[s.offset : s.offset + s.width] for key, s in slots.items()}
        self.columns = {key: self.host[:, s.offset : s.offset + s.width] for key, s in slots.items()}
        self.flagged = False  # the flags hold a signal, to be cleared before the row is sent again
        # This turn's gather: the callers that put (their key, what gets their columns), the step, the collective,
        # and on CUDA the event after the copy to the host.
        self.put: list[tuple[str, Callable[[int, Tensor], None]]] = []
        self.step = -1
        self.work: Optional[dist.Work] = None
        self.copied: Any = None


class _HostCopy:
    """CUDA: brings a gathered row to the host without a host sync in the step. ``torch.tensor(..., device=cuda)``
    copies with ``non_blocking=False`` (a ``memcpy_and_sync``), and ``gathered.cpu()`` a step later waits behind that
    step's backward and update on the current stream: either way the host could never run ahead of the GPU. Here
    the flags are filled on the device (no copy), a side stream waits for the collective (``Work.wait()`` makes the
    *current* stream wait; NCCL's returns at once) and copies the rows into pinned memory with ``non_blocking``, and
    an event recorded after it is waited for a step later, when it has long completed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def flags(flags: Tensor, sigterm: bool, requeue: bool) -> None:
        flags.zero_()
        for i, flag in enumerate((sigterm, requeue)):
            if flag:
                flags[i].fill_(1.0)  # a fill kernel with the value as its argument: no host-to-device copy

    def start(self, gathered: Tensor, host: Tensor, work: Optional[dist.Work]) -> Any:
        """Queues the copy of ``gathered`` (once ``work`` is done) into the pinned ``host``; the event that says it
        is there."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # world size 1: the row's own kernels
        with torch.cuda.stream(self.stream):
            if work is not None:
                work.wait()  # the side stream waits for the collective's stream; the host does not
            host.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        gathered.record_stream(self.stream)  # a new layout drops these buffers: not reused before the copy ran
        return copied

    @staticmethod
    def wait(copied: Any) -> None:
        copied.synchronize()  # a step later: long completed, so this returns at once


class StepSync(LeanCallback):
    """Carries per-step values of every rank to every rank in one ``all_gather``, and SIGTERM with them.

    Args:
        sigterm_every_n_steps: Check for SIGTERM at least every n steps (a step that gathers anyway always
            checks). Between checks a step that nobody else needs has no collective and no host read.
        uneven: Ranks whose data ends at different batches of an epoch: ``stop`` ends every rank's epoch at the
            last batch every rank has and says so; ``error`` raises ``UnevenDataError`` on every rank, before any
            runs out (``lit_ddp.run.even_epochs``).
    """

    # Rank 0's, sent back to a launching parent (ddp_fork/ddp_spawn): a SIGTERM that reached a rank but not the
    # parent ends the run there too (``lit_ddp.run.spawn_launcher.CarryBackLauncher``).
    carried_back = ("ending",)

    def __init__(self, sigterm_every_n_steps: PositiveInt = 10, uneven: Uneven = "stop") -> None:
        if sigterm_every_n_steps < 1:
            raise ValueError(f"`StepSync(sigterm_every_n_steps={sigterm_every_n_steps!r})` must be >= 1")
        if uneven not in ("stop", "error"):
            raise ValueError(f"`StepSync(uneven={uneven!r})` must be 'stop' or 'error'")
        self.sigterm_every_n_steps = sigterm_every_n_steps
        self.uneven = uneven
        self._even: Optional[EvenEpochs] = None
        self._device = torch.device("cpu")
        self._world_size = 1
        self._slots: dict[str, _Slot] = {}  # the row's layout: each caller's columns
        self._pair: list[_Rows] = []  # the two turns' buffers, made at the start of training and on a new layout
        self._turn = 0  # which of the two this step's callers write into
        self._in_flight: Optional[_Rows] = None  # the gather sent and not yet read
        self._host_copy: Optional[_HostCopy] = None  # made in setup, on CUDA
        self._profiles: Optional[list] = None  # [the Trainer's ProfilesSteps callback or None], found at the first step
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
        if sync is None:  # added to the user's Trainer (docs/callbacks.md lists every callback the tool adds)
            sync = StepSync()
            callbacks.append(sync)
            sync.setup(trainer, trainer.lightning_module, "fit")
        elif caller in callbacks and callbacks.index(sync) < callbacks.index(caller):
            callbacks.remove(sync)
            callbacks.insert(callbacks.index(caller) + 1, sync)
        return sync

    def reserve(self, key: str, width: int, on_result: Callable[[int, Tensor], None]) -> Tensor:
        """This rank's ``width`` columns in this step's row, float64 on the root device, to be written by the caller
        now (a preallocated buffer: ``copy_`` into it, or ``out=`` it); after the step's collective (in this
        callback's ``on_train_batch_end``, after those of the callbacks before it) ``on_result`` gets the step and
        every rank's values, ``[world_size, width]`` float64 on the CPU, valid during the call only: at the end of
        the next step, or of this one if it is the last. Every rank must reserve the same keys and widths."""
        slot = self._slots.get(key)
        if slot is None or slot.width != width:
            self._lay_out(key, width)
        rows = self._pair[self._turn]
        if rows.put and any(put_key == key for put_key, _ in rows.put):  # again in one step: its latest values
            rows.put = [(k, f) for k, f in rows.put if k != key]
        rows.put.append((key, on_result))
        return rows.values[key]

    def put(self, key: str, values: list[float] | Tensor, on_result: Callable[[int, Tensor], None]) -> None:
        """``reserve`` and fill: ``values`` (a tensor, or floats from the host) copied into this step's row."""
        if isinstance(values, Tensor):
            # A value copy (a float32 loss is exact in the row); bits to carry are a caller's reserve and its view.
            self.reserve(key, values.numel(), on_result).copy_(values.detach().reshape(-1))
            return
        host = torch.tensor(values, dtype=torch.float64)
        on_cuda = self._device.type == "cuda"  # from the host: pinned, so that the copy to a GPU does not wait
        self.reserve(key, len(values), on_result).copy_(host.pin_memory() if on_cuda else host, non_blocking=on_cuda)

    def _lay_out(self, key: str, width: int) -> None:
        """A key or width not seen in this fit (its first steps; a count the uneven data check adds): a new layout,
        new buffers for both turns. This step's values put so far are carried over; a gather in flight keeps the
        buffers it was sent from."""
        widths = {k: s.width for k, s in self._slots.items() if k != key}
        widths[key] = width
        self._slots, offset = {}, 2
        for k, w in widths.items():
            self._slots[k] = _Slot(offset, w)
            offset += w
        before = self._pair[self._turn] if self._pair else None
        self._pair = [_Rows(self._slots, self._world_size, self._device, self._host_copy is not None) for _ in range(2)]
        if before is not None:
            rows = self._pair[self._turn]
            rows.put = [(k, f) for k, f in before.put if k != key]
            for k, _ in rows.put:
                rows.values[k].copy_(before.values[k])

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
        # Added to the user's Trainer (docs/callbacks.md lists every callback the tool adds): its mark at a step's
        # end comes before the gather.
        CollectiveRecorder.attach(trainer, before=self)
        self._device = trainer.strategy.root_device
        self._host_copy = _HostCopy(self._device) if self._device.type == "cuda" else None
        self._sigterm, self.ending, self._profiles = False, Ending.FINISHED, None
        self._start(trainer.world_size)
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

    def _start(self, world_size: int) -> None:
        """A fit's empty row (the flags alone) and nothing in flight."""
        self._world_size, self._slots, self._turn, self._in_flight = world_size, {}, 0, None
        self._pair = [_Rows({}, world_size, self._device, self._host_copy is not None) for _ in range(2)]

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
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._even is not None:
            self._even.epoch_end(trainer)  # a rank that had no batch this epoch gives its count here

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self._alive_at = time.monotonic()
        if not self._steps.ended(trainer):  # a micro-batch
            return
        self._finish(trainer)  # the previous step's gather: long done by now
        if self._even is not None:
            self._even.step_end(trainer, self.put)
        put = bool(self._pair[self._turn].put)
        if trainer.world_size == 1:  # nobody to agree with: this rank's own flags decide, no tensor needed
            if put:
                self._send(trainer)
                self._finish(trainer)
            self._decide(trainer, self._sigterm, self._requeue)
            return
        # Every rank must take the same branch here: it depends on what was put (every rank puts the same keys) and
        # the step, never on a signal flag, which each rank's handler sets at its own moment (a rank gathering
        # alone pairs its all-gather with another rank's bucket all-reduce). A flag waits for the next row.
        if put or trainer.global_step % self.sigterm_every_n_steps == 0:
            self._send(trainer)
        if is_last_step(trainer, batch_idx) or trainer.should_stop or self._profiler_toggles_next(trainer):
            self._finish(trainer)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A NaN or a sync error raises before a checkpoint holding its step is written, wherever the checkpoint
        # callback is listed (before this one, this step's values are not even sent yet).
        self._finish(trainer)
        if self._pair and self._pair[self._turn].put:
            self._send(trainer)
            self._finish(trainer)

    def _send(self, trainer: Trainer) -> None:
        """Starts the gather of this step's row (the SIGTERM and requeue flags, then what was put) from this turn's
        buffers, and hands the next step the other turn's."""
        rows = self._pair[self._turn]
        signal = self._sigterm or self._requeue
        if signal or rows.flagged:  # the usual step, where no rank has a signal, writes no flag
            if self._host_copy is not None:
                _HostCopy.flags(rows.flags, self._sigterm, self._requeue)
            else:
                rows.flags.copy_(torch.tensor([float(self._sigterm), float(self._requeue)], dtype=torch.float64))
            rows.flagged = signal
        rows.step = trainer.global_step - 1
        if trainer.world_size > 1:
            rows.work = _torch.all_gather_started(rows.flat, rows.row)
            self.collectives += 1
        if self._host_copy is not None:
            rows.copied = self._host_copy.start(rows.gathered, rows.host, rows.work)
            rows.work = None  # the side stream waited for it
        self._in_flight = rows
        self._turn ^= 1

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer)  # training stopped early (a SIGTERM, another callback): the last step's results

    def settle(self, trainer: Trainer) -> None:
        """Hands out now the results of the gather in flight, if any: for a caller's ``on_train_end``, which runs
        before this callback's. Training that another callback stopped after this one's batch end (its
        ``should_stop``) ends with the last step's row still in flight. Every rank calls it at the same point."""
        self._finish(trainer)

    def _finish(self, trainer: Trainer) -> None:
        """Waits for the gather in flight, if any, and hands each caller its columns; every rank takes the same
        decisions from the same rows."""
        rows, self._in_flight = self._in_flight, None
        if rows is None:
            return
        if rows.work is not None:
            rows.work.wait()
            rows.work = None
        if rows.copied is not None:
            _HostCopy.wait(rows.copied)
            rows.copied = None
        put, rows.put = rows.put, []
        for key, on_result in put:
            on_result(rows.step, rows.columns[key])
        if rows.host_flags.any():  # one test for the usual step, where no rank has a signal
            flags = rows.host_flags
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
