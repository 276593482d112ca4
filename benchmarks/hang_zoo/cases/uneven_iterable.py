"""Unequal data: an ``IterableDataset`` sharded by hand, 8 batches an epoch on rank 0 and 5 on rank 1; rank 1's
epoch ends while rank 0 waits in its next step's all-reduce (Lightning#20404, #9851: "It will hang if there is an
uneven number of batches")."""

import os

import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, IterableDataset

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import DIM, Net, hang_starts, trainer

EXPECT = Hang(rank=1, line=None, cause="uneven data", avoidable=True)  # StepSync evens the epochs


class Shard(IterableDataset):
    def __iter__(self):
        batches = {"0": 8, "1": 5}[os.environ.get("LOCAL_RANK", "0")]
        for i in range(batches):
            x = torch.full((4, DIM), i / 8)
            yield x, x.sum(1, keepdim=True)


class MarkTheEnd(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == 1:
            hang_starts()


if __name__ == "__main__":
    trainer([MarkTheEnd()], use_distributed_sampler=False).fit(Net(), DataLoader(Shard(), batch_size=None))
