"""Under ``python -m lit_ddp.fit``: rank 1 stops in its step outside any collective (Lightning#11841, "freezes
without errors"), with the CLI's own strategy (LitDDPStrategy) and callbacks."""

import time

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import hang_starts
from lit_ddp import LinearRegression

EXPECT = Hang(rank=1, line="time.sleep(3600)", cause="outside any collective")
COMMAND = ["-m", "lit_ddp.fit", "--devices", "2", "--trainer.accelerator", "cpu", "--model", f"{__name__}.Case",
           "--model.dim", "16", "--trainer.max_steps", "40", "--trainer.strategy.timeout_s", "{timeout_s}"]  # fmt: skip


class Case(LinearRegression):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            time.sleep(3600)
        return super().training_step(batch, batch_idx)
