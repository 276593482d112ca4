"""Healthy: a fit, then a test of 20 batches of 1 s on each rank, its loss logged with ``sync_dist`` (reduced at the
test's end). Each test batch is progress: no line may say the ranks have stopped."""

import time

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import Net, loader, trainer

EXPECT = Healthy()


class Case(Net):
    def test_step(self, batch, batch_idx):
        time.sleep(1.0)
        loss = self.loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss


if __name__ == "__main__":
    fit = trainer(max_epochs=1)
    model = Case()
    fit.fit(model, loader())
    fit.test(model, loader(160))
