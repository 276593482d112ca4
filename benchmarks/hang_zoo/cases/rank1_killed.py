"""Rank 1 is killed by SIGKILL, as the kernel's OOM killer does (Lightning#15008: an OOM or a cancelled job in DDP
leaves processes behind): no handler of its own runs."""

import os
import signal

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line=None, cause="dead rank")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
