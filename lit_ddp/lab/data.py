"""Fixed random batches, one shard per rank: the notes' ``x = torch.randn(32, 1024)``, made deterministic.

    python -m lit_ddp.fit --devices 2 --data.batch_size 32 --data.seed 0

From one ``seed`` the data module draws a *global* batch of ``batch_size * world_size`` rows; rank ``r``
trains on rows ``[r * batch_size, (r + 1) * batch_size)``, the same rows every step. So DDP on N ranks with
batch B sees exactly the data of one process with batch N * B, which is what makes the gradient sync
checkable: both must train identically.
"""

from collections.abc import Iterator
from typing import Any, Optional

import torch
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch import LightningDataModule
from torch import Tensor


def global_batch(dim: int, rows: int, seed: int) -> tuple[Tensor, Tensor]:
    """The whole global batch ``(x, y)``, each ``rows x dim``, drawn on the CPU from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)
    y = torch.randn(rows, dim, generator=gen)
    return x, y


def shard(dim: int, batch_size: int, seed: int, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s rows of the global batch."""
    x, y = global_batch(dim, batch_size * world_size, seed)
    rows = slice(rank * batch_size, (rank + 1) * batch_size)
    return x[rows].clone(), y[rows].clone()


class RepeatBatch:
    """One batch, ``length`` times: an epoch of the fixed-batch experiment.

    A plain sized iterable rather than a ``DataLoader``: there is nothing to load, and it keeps Lightning from
    adding a ``DistributedSampler`` (which forces ``shuffle=True``) on top of our own sharding. Its length
    gives epochs a meaning (``max_epochs``, ``val_check_interval``, epoch-based checkpoints).
    """

    def __init__(self, batch: tuple[Tensor, Tensor], length: int) -> None:
        self.batch = batch
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(self.length):
            yield self.batch

    # Resumable, as Lightning asks of a loader resumed in mid-epoch (else it warns that results may differ): there
    # is no position to keep. Every batch is the same one, and the epoch's end comes from Lightning's own batch
    # counter, restored from the checkpoint; so a resumed run ends bitwise equal to an uninterrupted one.
    def state_dict(self) -> dict[str, Any]:
        return {"length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("length", self.length) != self.length:
            raise ValueError(f"`RepeatBatch`: the checkpoint's epoch has {state['length']} steps, this one "
                             f"{self.length} (--data.steps_per_epoch)")  # fmt: skip


class FixedBatchDataModule(LightningDataModule):
    """The same random batch every step, a different shard on every rank.

    Args:
        dim: Feature width of inputs and targets; ``None``: the model's ``hparams.dim`` (``fit`` sets it so).
        batch_size: Rows per rank per step (the notes: 32).
        seed: Seed of the global batch. The model's initial weights come from ``seed_everything``.
        steps_per_epoch: Steps in one epoch (``--trainer.max_steps`` still ends the notes' run at 5).
    """

    def __init__(
        self,
        dim: Optional[PositiveInt] = None,
        batch_size: PositiveInt = 32,
        seed: NonNegativeInt = 0,
        steps_per_epoch: PositiveInt = 100,
    ) -> None:
        super().__init__()
        if (dim is not None and dim < 1) or batch_size < 1 or seed < 0 or steps_per_epoch < 1:
            raise ValueError(
                f"`FixedBatchDataModule(dim={dim!r}, batch_size={batch_size!r}, seed={seed!r}, "
                f"steps_per_epoch={steps_per_epoch!r})`: dim, batch_size and steps_per_epoch must be >= 1, seed >= 0"
            )
        self.save_hyperparameters()
        self.batch: tuple[Tensor, Tensor] | None = None

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        dim = self.hparams.dim or trainer.lightning_module.hparams.get("dim")
        if dim is None:
            raise ValueError("`FixedBatchDataModule(dim=None)` needs a model with `hparams.dim` (the width to draw)")
        x, y = shard(dim, self.hparams.batch_size, self.hparams.seed, trainer.global_rank, trainer.world_size)
        # One host-to-device copy for the whole run; Lightning's per-step transfer is then a no-op.
        device = trainer.strategy.root_device
        self.batch = (x.to(device), y.to(device))

    def train_dataloader(self) -> RepeatBatch:
        assert self.batch is not None, "setup() was not called"
        return RepeatBatch(self.batch, self.hparams.steps_per_epoch)
