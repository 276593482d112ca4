"""``self.all_gather`` of the validation outputs in ``on_validation_epoch_end`` under ``if
self.trainer.is_global_zero`` (Lightning#19783: "DDP strategy doesn't work for on_validation_epoch_end, always
hang")."""

import torch

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="self.all_gather(torch.stack(self.outputs))", cause="collective on some ranks",
              certain=True)  # fmt: skip


class Case(Net):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        self.outputs.append(self.loss(batch))

    def on_validation_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            hang_starts()
            everyone = self.all_gather(torch.stack(self.outputs))
            print(f"validation loss {everyone.mean():.3f}")
        self.outputs.clear()


if __name__ == "__main__":
    trainer(limit_val_batches=2).fit(Case(), loader(), loader(16))
