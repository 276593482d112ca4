"""Under ``python -m lit_ddp.fit``: ``self.all_gather`` in ``training_step`` under ``if self.global_rank == 0``
(Lightning#19783: a gather for rank 0's metric, the others never call it)."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import hang_starts
from lit_ddp import LinearRegression

EXPECT = Hang(rank=0, line="self.all_gather(loss)", cause="collective on some ranks", certain=True)
COMMAND = ["-m", "lit_ddp.fit", "--devices", "2", "--trainer.accelerator", "cpu", "--model", f"{__name__}.Case",
           "--model.dim", "16", "--trainer.max_steps", "40", "--trainer.strategy.timeout_s", "{timeout_s}"]  # fmt: skip


class Case(LinearRegression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 0 and self.global_step == 3:
            hang_starts()
            self.all_gather(loss)
        return loss
