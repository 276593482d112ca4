"""Healthy: rank 1 is slower at every step (0.3 s more), a straggler, not a hang."""

import time

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import Net, loader, trainer

EXPECT = Healthy()


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            time.sleep(0.3)
        return self.loss(batch)


if __name__ == "__main__":
    trainer(max_epochs=2).fit(Case(), loader())
