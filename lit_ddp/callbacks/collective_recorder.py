"""Where each rank is in its step, for the record of its collectives; and, when training fails, why it hung.

    python tests/hang_scripts.py logkeys      # rank 1 logs a key rank 0 does not: one line names it

A few marks per step (``lit_ddp.measure.collectives``), and nothing else until an exception: then the rank's
report goes to the others and the diagnosis is made (``lit_ddp.run.hangs``). StepSync adds it (every tool
callback brings a StepSync), just before itself: its mark at a step's end comes before StepSync's gather.
docs/failures.md#why-did-it-hang.
"""

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_ddp import _lightning, _torch
from lit_ddp._lightning import LeanCallback
from lit_ddp.errors import prog
from lit_ddp.measure.collectives import CollectiveRecord
from lit_ddp.run import hangs

# A callback alone, under a strategy that leaves torch's default (Lightning's DDPStrategy: 30 minutes), sets this.
SHORT_TIMEOUT_S = 120.0


class CollectiveRecorder(LeanCallback):
    """Marks each step's phases for the collective record, and diagnoses a failure on every rank it reaches.

    Args:
        timeout_s: Under a strategy whose process group waits torch's default 30 minutes (Lightning's own
            ``DDPStrategy``), set the group's timeout to this many seconds at start (where torch allows it, said
            in one line); ``None`` leaves it. LitDDPStrategy's ``timeout_s`` is left as it is.
    """

    def __init__(self, timeout_s: Optional[float] = SHORT_TIMEOUT_S) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"`CollectiveRecorder(timeout_s={timeout_s!r})` must be > 0 or None")
        self.timeout_s = timeout_s
        self.collective_record = CollectiveRecord()
        self._step = 0

    @staticmethod
    def attach(trainer: Trainer, before: Callback) -> None:
        """Adds one to the Trainer's callbacks, just before ``before``, unless it has one."""
        callbacks = trainer.callbacks
        if not any(isinstance(c, CollectiveRecorder) for c in callbacks):
            callbacks.insert(callbacks.index(before) if before in callbacks else len(callbacks), CollectiveRecorder())

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record = CollectiveRecord()  # one per fit
        self.collective_record.mark(trainer.global_step, "the start of training")
        if trainer.world_size < 2 or self.timeout_s is None or not dist.is_initialized():
            return
        if getattr(trainer.strategy, "timeout_s", None) is not None:  # LitDDPStrategy: its own, short already
            return
        timeout = _lightning.process_group_timeout(trainer.strategy)
        if timeout is not None and timeout.total_seconds() <= self.timeout_s:
            return
        if _torch.set_pg_timeout(timedelta(seconds=self.timeout_s)):
            rank_zero_info(f"{prog()}: the process group's timeout is now {self.timeout_s:g} s, not Lightning's 30 "
                           "minutes (CollectiveRecorder(timeout_s=...) sets it)")  # fmt: skip

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step
        self.collective_record.mark(self._step, "training_step")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self.collective_record.mark(self._step, "backward")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.collective_record.mark(self._step, "the optimizer step")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.collective_record.mark(self._step, "the end of the step")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, f"the end of epoch {trainer.current_epoch}")

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, "validation")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.collective_record.mark(self._step, "the end of training")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        hangs.diagnose(trainer, exception)
