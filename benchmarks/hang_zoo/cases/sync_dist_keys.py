"""Rank 1 logs a key with ``sync_dist=True`` that rank 0 does not (a metric logged only when a batch has it):
rank 1's sync is an all-reduce that rank 0 never calls (Lightning#19106)."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line='self.log("rare_metric", loss, sync_dist=True)', cause="sync_dist keys", certain=True)


class Case(Net):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, sync_dist=True)
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            self.log("rare_metric", loss, sync_dist=True)
        return loss


if __name__ == "__main__":
    trainer().fit(Case(), loader())
