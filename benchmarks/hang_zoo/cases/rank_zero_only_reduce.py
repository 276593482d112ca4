"""An evaluation under ``@rank_zero_only`` at the end of validation that reduces a score across ranks
(Lightning#15860: single-GPU sampling while training on several, with ``@rank_zero_only``)."""

import torch
from lightning.pytorch.utilities import rank_zero_only

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line='self.trainer.strategy.reduce(score, reduce_op="mean")', cause="collective on some ranks",
              certain=True)  # fmt: skip


class Case(Net):
    def validation_step(self, batch, batch_idx):
        return self.loss(batch)

    def on_validation_epoch_end(self) -> None:
        self.evaluate_sampling()

    @rank_zero_only
    def evaluate_sampling(self) -> None:
        score = self.layer(torch.ones(1, 8)).sum()
        hang_starts()
        mean = self.trainer.strategy.reduce(score, reduce_op="mean")
        print(f"sample score {mean:.3f}")


if __name__ == "__main__":
    trainer(limit_val_batches=2).fit(Case(), loader(), loader(16))
