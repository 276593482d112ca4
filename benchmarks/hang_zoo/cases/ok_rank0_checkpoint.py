"""Healthy: rank 0 alone writes and uploads a checkpoint for longer than the watchdog's threshold at each epoch's
end (plain ``torch.save``, no collective), while rank 1 waits for it in the next step's all-reduce (lit_ddp#52: such
work must never be ended as a hang)."""

import time

import torch
from lightning.pytorch import Callback

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import LONG_S, Net, loader, trainer

EXPECT = Healthy()


class Upload(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero and trainer.current_epoch == 0:
            torch.save(pl_module.state_dict(), "weights.pt")
            time.sleep(LONG_S)  # the upload


if __name__ == "__main__":
    trainer([Upload()]).fit(Net(), loader())
