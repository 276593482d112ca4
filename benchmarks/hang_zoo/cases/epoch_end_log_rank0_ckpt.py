"""Logging with ``sync_dist=True`` in ``on_train_epoch_end`` under ``if self.trainer.is_global_zero``, with
Lightning's default checkpointing on, as a user has it (Lightning#19604): rank 0's sync all-reduces a float while
rank 1 has gone on to ModelCheckpoint's ``reduce_boolean_decision``, whose message is larger; gloo aborts rank 0
on it (SIGABRT) within a second, unless lit_ddp holds that abort while it names the divergence."""

import torch

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line='self.log("epoch_metric", value, sync_dist=True)', cause="collective on some ranks",
              certain=True)  # fmt: skip


class Case(Net):
    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            value = torch.tensor(1.0)
            hang_starts()
            self.log("epoch_metric", value, sync_dist=True)


if __name__ == "__main__":
    trainer(enable_checkpointing=True).fit(Case(), loader())
