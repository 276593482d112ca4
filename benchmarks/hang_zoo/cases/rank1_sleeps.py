"""Rank 1 stops in its step, outside any collective (a blocking call, a debugger): the job "freezes without
errors" (Lightning#11841)."""

import time

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line="time.sleep(3600)", cause="outside any collective")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            time.sleep(3600)
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
