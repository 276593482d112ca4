"""Under ``python -m lit_ddp.fit`` (LitDDPStrategy) with Lightning's checkpointing on: ``self.log(...,
sync_dist=True)`` in ``on_train_epoch_end`` under ``if self.trainer.is_global_zero`` (Lightning#19604): rank 0's
sync meets rank 1's ModelCheckpoint decision, whose message is larger, and gloo aborts rank 0 on it."""

import torch

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import hang_starts
from lit_ddp import LinearRegression

EXPECT = Hang(rank=0, line='self.log("epoch_metric", value, sync_dist=True)', cause="collective on some ranks",
              certain=True)  # fmt: skip
COMMAND = ["-m", "lit_ddp.fit", "--devices", "2", "--trainer.accelerator", "cpu", "--model", f"{__name__}.Case",
           "--model.dim", "16", "--trainer.max_epochs", "2", "--trainer.enable_checkpointing", "true",
           "--trainer.strategy.timeout_s", "{timeout_s}"]  # fmt: skip


class Case(LinearRegression):
    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            value = torch.tensor(1.0)
            hang_starts()
            self.log("epoch_metric", value, sync_dist=True)
