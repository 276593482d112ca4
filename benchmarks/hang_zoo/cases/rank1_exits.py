"""Rank 1's process ends in the middle of training (``os._exit``, as a C extension's abort does): Lightning#8130,
"DDP script hangs forever if one child process dies"."""

import os

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line=None, cause="dead rank")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            os._exit(3)
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
