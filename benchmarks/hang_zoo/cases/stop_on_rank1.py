"""Rank 1 decides alone to stop (``should_stop`` set from its own metric, as a hand-made early
stopping does): it leaves training while rank 0 goes on (Lightning#379, "Early stopping with ddp bug")."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line="self.trainer.should_stop = True", cause="left training early")


class Case(Net):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            self.trainer.should_stop = True
        return loss


if __name__ == "__main__":
    trainer(max_epochs=20).fit(Case(), loader())
