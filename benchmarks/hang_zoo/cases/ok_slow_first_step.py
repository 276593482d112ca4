"""Healthy: a first step longer than the watchdog's threshold on every rank (compilation, a cold cache)."""

import time

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import LONG_S, Net, loader, trainer

EXPECT = Healthy()


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.global_step == 0:
            time.sleep(LONG_S)
        return self.loss(batch)


if __name__ == "__main__":
    trainer(max_epochs=1).fit(Case(), loader())
