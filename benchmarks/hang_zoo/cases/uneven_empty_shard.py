"""Unequal data at its extreme: rank 1's shard of an ``IterableDataset`` is empty (more ranks than shards), so rank
1 never reaches an epoch's first batch while rank 0 waits in the first step's all-reduce (webdataset#188: "If a
train process ends up with no shards, it will hang training")."""

import os

import torch
from torch.utils.data import DataLoader, IterableDataset

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import DIM, Net, hang_starts, trainer

EXPECT = Hang(rank=1, line=None, cause="uneven data", avoidable=True)


class Shards(IterableDataset):
    def __iter__(self):
        files = {"0": ["shard-000000.tar"], "1": []}[os.environ.get("LOCAL_RANK", "0")]
        if not files:
            hang_starts()
        for _ in files:
            for i in range(8):
                x = torch.full((4, DIM), i / 8)
                yield x, x.sum(1, keepdim=True)


if __name__ == "__main__":
    trainer(use_distributed_sampler=False).fit(Net(), DataLoader(Shards(), batch_size=None))
