"""Rank 0 waits in its step on an event that no thread will set (a producer thread that died): a wait with no
timeout on a lock of its own process, outside any collective, while rank 1 waits in the all-reduce (Lightning#11841:
a job that freezes without errors). Its line reads like the wait on a collective's work."""

import threading

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

READY = threading.Event()
EXPECT = Hang(rank=0, line="READY.wait()", cause="outside any collective")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 0 and self.global_step == 4:
            hang_starts()
            READY.wait()
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
