"""A gate every rank applies, except that rank 1 skips it at step 2 (a data-dependent shortcut, taken after the
first step): rank 1's DDP gets no gradient for ``gate.weight`` and ``gate.bias`` there and fails at its next forward
("Expected to have finished reduction in the prior iteration", pytorch#43259; "running different branches in your
code in DDP mode", mmdetection#4742), while rank 0 waits in the all-reduce that rank 1 never starts."""

import torch

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import DIM, Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line=None, cause="unused parameters", also=("gate.weight",))


class Case(Net):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(DIM, DIM)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1 and self.global_step == 2:
            hang_starts()
            h = x
        else:
            h = x * torch.sigmoid(self.gate(x))
        return torch.nn.functional.mse_loss(self.layer(h), y)


if __name__ == "__main__":
    trainer().fit(Case(), loader())
