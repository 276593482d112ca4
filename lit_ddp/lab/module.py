"""The notes' task: a stack of ``nn.Linear(dim, dim)`` regressed onto fixed random targets with Adam.

    python -m lit_ddp.fit --model.dim 1024 --model.lr 1e-3

The notes' pitfall ("create the optimizer after wrapping with DDP") cannot happen here: Lightning wraps
the module in ``DistributedDataParallel`` during ``strategy.setup`` and calls ``configure_optimizers``
after that, so the optimizer holds the very parameter tensors that DDP broadcasts and all-reduces.

The error is also tracked by a torchmetrics ``MeanSquaredError``: updated every step on each rank without a
collective (it only adds to two state tensors), then logged once per epoch, in ``on_train_epoch_end``, as
``train/mse``, where Lightning computes it (torchmetrics' one sync across ranks) and resets it: the mean squared
error over every element of every rank's rows of the epoch. Logging the metric object from ``training_step``
instead (``on_step=False, on_epoch=True``) would cost a pass of Lightning's logging machinery every step,
some 2 ms a step under cProfile at dim 64 for a value read once an epoch. The per-step printed loss stays in
the step's one collective (``LossMonitor``).
"""

from typing import Optional

import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import MeanSquaredError


class LinearRegression(LightningModule):
    """``num_layers`` x ``nn.Linear(dim, dim)`` trained with ``((out - y) ** 2).mean()`` and Adam.

    Args:
        dim: Width of every Linear layer (the notes: 1024; the profiled variant: 4096).
        num_layers: How many Linear layers to stack. 1 is the notes' model; more layers give DDP
            several gradient buckets, so all-reduce can overlap with backward.
        lr: Adam learning rate.
        betas: Adam's (beta1, beta2).
        foreach: torch's multi-tensor Adam; ``None`` lets torch choose.
        fused: torch's fused Adam kernel (one kernel for the whole update); ``None`` lets torch choose.
    """

    def __init__(
        self,
        dim: PositiveInt = 1024,
        num_layers: PositiveInt = 1,
        lr: PositiveFloat = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
    ) -> None:
        super().__init__()
        # jsonargparse checks the annotations on the command line; these checks cover Python callers.
        for name, value in (("dim", dim), ("num_layers", num_layers), ("lr", lr)):
            if not value > 0:
                raise ValueError(f"`LinearRegression({name}={value!r})` must be > 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"`LinearRegression(betas={betas!r})` must be in [0, 1)")
        if foreach and fused:
            raise ValueError("`LinearRegression(foreach=True, fused=True)`: choose one Adam implementation")
        self.save_hyperparameters()
        self.net = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(num_layers)))
        self.train_mse = MeanSquaredError()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        # The local loss over this rank's rows; DDP averages the gradients, which makes the update that of
        # the global mean loss. LossMonitor prints that global mean.
        self.train_mse.update(out.detach(), y)
        return ((out - y) ** 2).mean()

    def on_train_epoch_end(self) -> None:
        # A Metric object: Lightning calls compute() (torchmetrics' one sync across ranks) and reset() on it.
        self.log("train/mse", self.train_mse)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.Adam(self.parameters(), lr=hp.lr, betas=tuple(hp.betas), foreach=hp.foreach, fused=hp.fused)
