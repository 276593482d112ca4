"""A head that only rank 1 uses after step 3 (a data-dependent branch): DDP waits for gradients that rank 0 never
makes (allennlp#3574: parameters unused by a conditional branch need ``find_unused_parameters``; lit_ddp#48: neither
rank 1 nor ``b.weight``, ``b.bias`` were named)."""

import torch

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import DIM, Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line=None, cause="unused parameters", also=("b.weight",))


class Case(Net):
    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Linear(DIM, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1 and self.global_step >= 3:
            hang_starts()
            return torch.nn.functional.mse_loss(self.layer(x) + self.b(x), y)
        return torch.nn.functional.mse_loss(self.layer(x), y)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
