"""A callback's hook under ``@rank_zero_only`` that saves a checkpoint at the end of an epoch: the other rank
never joins the save's barrier and goes on to the next epoch (Lightning#16417: stuck after epoch 0; removing the
``@rank_zero_only`` fixed it)."""

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line='trainer.save_checkpoint("epoch.ckpt")', cause="collective on some ranks", certain=True)


class SaveEachEpoch(Callback):
    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module):
        hang_starts()
        trainer.save_checkpoint("epoch.ckpt")


if __name__ == "__main__":
    trainer([SaveEachEpoch()]).fit(Net(), loader())
