"""Where each rank is in its step, for the record of its collectives; and, when training fails, why it hung.

    python tests/hang_scripts.py logkeys      # rank 1 logs a key rank 0 does not: one line names it

A few marks per step (``lit_ddp.measure.collectives``) and the watchdog's beat (``lit_ddp.run.watchdog``), and
nothing else until the rank stops moving (the watchdog) or an exception: then the rank's report goes to the others
and the diagnosis is made (``lit_ddp.run.hangs``). StepSync adds it (every tool
callback brings a StepSync), just before itself: its mark at a step's end comes before StepSync's gather.
docs/failures.md#why-did-it-hang.
"""

import time
from collections.abc import Collection
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_ddp import _lightning, _torch
from lit_ddp.analysis.user_source import Stopped
from lit_ddp.measure import clock
from lit_ddp.measure.collectives import CollectiveRecord
from lit_ddp.measure.gradients import check_all_used
from lit_ddp.records import phases
from lit_ddp.records.schema import CollectiveCall
from lit_ddp.run import console, frozen, hangs, launched, lifecycle, start_watch, watchdog
from lit_ddp.run.lean import LeanCallback


class CollectiveRecorder(LeanCallback):
    """Marks each step's phases for the collective record, beats this rank's watchdog (``lit_ddp.run.watchdog``,
    started in ``setup`` where neither LitDDPStrategy nor the start watch, ``lit_ddp.run.start_watch``, has started
    it already), and diagnoses a failure on every rank it
    reaches. It leaves the process group's timeout as the user set it: the watchdog names a hang long before."""

    def __init__(self) -> None:
        self.collective_record = CollectiveRecord()
        self._step = 0

    @staticmethod
    def attach(trainer: Trainer, before: Callback) -> None:
        """Adds one to the Trainer's callbacks, just before ``before``, unless it has one."""
        callbacks = trainer.callbacks
        if not any(isinstance(c, CollectiveRecorder) for c in callbacks):
            recorder = CollectiveRecorder()
            callbacks.insert(callbacks.index(before) if before in callbacks else len(callbacks), recorder)
            recorder.setup(trainer, trainer.lightning_module, "fit")  # Lightning's setup hooks may be past it

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        start_watch.disarm()  # it handed the rank to the watchdog at the process group's start, or ends here
        watch = watchdog.start(trainer.global_rank, trainer.world_size)
        watch.fit_over, watch.stopped = False, None  # a new fit in a process whose watchdog served one before
        watch.batches, watch.done = {}, {}  # and its loops' counts
        watch.alive()
        launched.remember(_lightning.launched_ranks(trainer.strategy), trainer.global_rank + 1)
        if trainer.world_size > 1:  # where a peer on this host reads it, should its Python stop (run/frozen.py)
            frozen.publish(_torch.default_store(), trainer.global_rank, watch.workers.dump_file)

    @staticmethod
    def calls_of(trainer: Trainer, steps: Collection[int]) -> list[CollectiveCall]:
        """This rank's collectives in ``steps``, from torch's Flight Recorder (read once, at the end of training),
        for the record; none without a CollectiveRecorder or a Flight Recorder."""
        found = next((c for c in trainer.callbacks if isinstance(c, CollectiveRecorder)), None)
        if found is None:
            return []
        return found.collective_record.calls(_torch.flight_recorder_entries(), steps, *_clocks_together())

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record = CollectiveRecord()  # one per fit
        self.collective_record.mark(trainer.global_step, "the start of training")
        watch = watchdog.start(trainer.global_rank, trainer.world_size)
        watch.record = self.collective_record
        watch.alive()

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        watchdog.count_batches("training", trainer.num_training_batches)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step
        self.collective_record.mark(self._step, "training_step")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self.collective_record.mark(self._step, phases.ALL_REDUCING)

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Once, after the first backward, under a strategy that does not check it itself (LitDDPStrategy does): DDP
        # would fail at the next forward with indices, or Lightning with no name; this rank's unused ones, by name.
        self.on_after_backward = None  # a per-step hook no more (LeanCallback's dispatch passes over None)
        model = trainer.strategy.model
        if trainer.world_size > 1 and isinstance(model, DistributedDataParallel) and not model.find_unused_parameters:
            if not hasattr(trainer.strategy, "timeout_s"):  # LitDDPStrategy checks in its post_backward
                check_all_used(pl_module, trainer.global_step, console.advice(trainer), trainer.global_rank)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.collective_record.mark(self._step, "the optimizer step")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.collective_record.mark(self._step, "the end of the step")
        watchdog.beat(trainer.global_step)
        watchdog.batch_done("training")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, f"the end of epoch {trainer.current_epoch}")

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, "validation")
        if not trainer.sanity_checking:
            watchdog.count_batches("validation", sum(trainer.num_val_batches))

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        watchdog.batch_done("validation")
        watchdog.alive()  # an evaluation's batch is progress

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, "test")
        watchdog.count_batches("test", sum(trainer.num_test_batches))

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, "predict")
        watchdog.count_batches("predict", sum(trainer.num_predict_batches))

    @override
    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        watchdog.batch_done("test")
        watchdog.alive()  # an evaluation's batch is progress

    @override
    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        watchdog.batch_done("predict")
        watchdog.alive()  # an evaluation's batch is progress

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, "the end of training")
        # A stop on one rank alone leaves the others waiting in its next collective (Lightning#379): where it was
        # set is found in the source only if a peer is seen waiting for this rank.
        classes = (type(pl_module), *map(type, trainer.callbacks))
        watchdog.fit_ended(Stopped(self._step, classes) if trainer.should_stop else None)  # the step it ended in

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        hangs.diagnose(trainer, exception)
        # Under Lightning's own DDPStrategy nothing else stops the ranks rank 0 launched (LitDDPStrategy does too)
        lifecycle.stop_launched_ranks(trainer.strategy, first_rank=trainer.global_rank + 1)


def _clocks_together(tries: int = 5) -> tuple[float, int]:
    """The host clock (``host_now``) and the system clock (Flight Recorder's) at one moment: of a few tries, the one
    whose two host reads around the system read are closest (a rank descheduled between two reads on a loaded
    machine was seen to put its collectives 32 ms off)."""
    best = None
    for _ in range(tries):
        before, wall, after = clock.host_now(), time.time_ns(), clock.host_now()
        if best is None or after - before < best[0]:
            best = (after - before, (before + after) / 2, wall)
    return best[1], best[2]
