"""Rank 0, which hosts the rendezvous store, stops in its step outside any collective (Lightning#11841, "freezes
without errors"; the store's host is the rank a store-based report must not depend on)."""

import time

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="time.sleep(3600)", cause="outside any collective")


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 0 and self.global_step == 3:
            hang_starts()
            time.sleep(3600)
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
