"""Logging with ``sync_dist=True`` in ``on_train_epoch_end`` under ``if self.trainer.is_global_zero``: rank 0's
sync waits for a rank that has gone on to the next epoch (Lightning#19604)."""

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
    trainer().fit(Case(), loader())
