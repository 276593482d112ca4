"""Healthy, under ``python -m lit_ddp.fit``: a first step longer than the watchdog's threshold on every rank."""

import time

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import LONG_S
from lit_ddp import LinearRegression

EXPECT = Healthy()
COMMAND = ["-m", "lit_ddp.fit", "--devices", "2", "--trainer.accelerator", "cpu", "--model", f"{__name__}.Case",
           "--model.dim", "16", "--trainer.max_steps", "10", "--trainer.strategy.timeout_s", "{timeout_s}"]  # fmt: skip


class Case(LinearRegression):
    def training_step(self, batch, batch_idx):
        if self.global_step == 0:
            time.sleep(LONG_S)
        return super().training_step(batch, batch_idx)
