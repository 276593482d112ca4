"""``self.trainer.save_checkpoint(...)`` in ``training_step`` under ``if self.trainer.is_global_zero``: saving is a
collective (a barrier), so rank 0 waits in it while rank 1 goes on to the gradients' all-reduce (Lightning#11267,
#19045: checkpointing that hangs DDP)."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line='self.trainer.save_checkpoint("rank0.ckpt")', cause="collective on some ranks",
              certain=True)  # fmt: skip


class Case(Net):
    def training_step(self, batch, batch_idx):
        if self.trainer.is_global_zero and self.global_step == 3:
            hang_starts()
            self.trainer.save_checkpoint("rank0.ckpt")
        return self.loss(batch)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
