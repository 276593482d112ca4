"""A DataLoader worker of rank 1 stuck in ``__getitem__`` (a dead network file system, a lock): rank 1 waits on
its worker, rank 0 in the all-reduce (pytorch#41517 "Dataloader in DistributedDataParallel hangs", #82077;
Lightning#11242). The workers must end with the job."""

import os
import time

import torch
from torch.utils.data import DataLoader

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import DIM, Net, Rows, hang_starts, trainer

EXPECT = Hang(rank=1, line="time.sleep(3600)", cause="stuck data worker")


class Files(Rows):
    def __getitem__(self, i: int):
        if os.environ.get("LOCAL_RANK") == "1" and i == 20:  # the worker inherits the rank's environment
            hang_starts()
            time.sleep(3600)
        x = torch.full((DIM,), (i % 16) / 16)
        return x, x.sum(0, keepdim=True)


if __name__ == "__main__":
    trainer().fit(Net(), DataLoader(Files(), batch_size=4, num_workers=1))
