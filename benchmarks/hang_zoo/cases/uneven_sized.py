"""Unequal data: each rank reads its own files, 32 rows on rank 0 and 20 on rank 1, without Lightning's sampler
(pytorch#141069: DDP hangs when the ranks' inputs are unequal; the Join context exists for it)."""

import os

from lightning.pytorch import Callback

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line=None, cause="uneven data", avoidable=True)  # StepSync evens the epochs


class MarkTheEnd(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == 1:
            hang_starts()


if __name__ == "__main__":
    rows = {"0": 32, "1": 20}[os.environ.get("LOCAL_RANK", "0")]
    trainer([MarkTheEnd()], use_distributed_sampler=False).fit(Net(), loader(rows))
