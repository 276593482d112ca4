"""Healthy: rank 0 alone runs an upload command (``subprocess.run``) for 12 s at the first epoch's end, no
collective, while rank 1 waits in the next step's all-reduce (lit_ddp#52's rank-0 upload, made by a child process):
a "waiting" line may name the child, none may say the job hung."""

import subprocess

from lightning.pytorch import Callback

from benchmarks.hang_zoo.expect import Healthy
from benchmarks.hang_zoo.user import Net, loader, trainer

EXPECT = Healthy()


class Upload(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero and trainer.current_epoch == 0:
            subprocess.run(["sleep", "12"], check=True)


if __name__ == "__main__":
    trainer([Upload()]).fit(Net(), loader())
