"""Healthy: a long validation on every rank, one batch longer than the watchdog's threshold (a generative model's
sampling), then training goes on."""

import time

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import LONG_S, Net, loader, trainer

EXPECT = Healthy()


class Case(Net):
    def validation_step(self, batch, batch_idx):
        time.sleep(LONG_S)
        self.log("val_loss", self.loss(batch), sync_dist=True)


if __name__ == "__main__":
    trainer(limit_val_batches=1, max_epochs=1, num_sanity_val_steps=0).fit(Case(), loader(), loader(16))
