"""Every rank gathers its own validation outputs in ``on_validation_epoch_end``, but rank 0 keeps two per batch and
rank 1 one: ``self.all_gather`` of tensors whose first dimension differs between ranks "freezes" (Lightning#7773);
under gloo the rank that receives more than it expects aborts in gloo's own thread."""

import torch

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="self.all_gather(torch.stack(self.outputs))", cause="different shapes", certain=True)


class Case(Net):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        self.outputs.append(self.loss(batch))
        if self.global_rank == 0:  # a data-dependent count in a real model: here, one rank's more
            self.outputs.append(self.loss(batch))

    def on_validation_epoch_end(self) -> None:
        hang_starts()
        everyone = self.all_gather(torch.stack(self.outputs))
        print(f"validation loss {everyone.mean():.3f}")
        self.outputs.clear()


if __name__ == "__main__":
    trainer(limit_val_batches=2).fit(Case(), loader(), loader(16))
