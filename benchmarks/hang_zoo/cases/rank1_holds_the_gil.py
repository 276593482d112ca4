"""Rank 1 in one long C call that holds the GIL (a sum over a huge range; a C extension's loop, a read in C): its
Python stops, its own watchdog thread and its SIGTERM handler with it, and it sends nothing, as a dead rank does.
A thread that holds the GIL stops every other thread of its process that needs it (pytorch#40495: DDP's
construction held it and deadlocked a peer's RPC). Read from a peer on its host (lit_ddp.run.frozen)."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line="sum(range(10**11))", cause="outside any collective")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            sum(range(10**11))
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
