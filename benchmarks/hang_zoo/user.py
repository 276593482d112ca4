"""What every zoo case shares, as a user's own script would have it: a small model, its data, and a plain
``Trainer`` on 2 CPU ranks under Lightning's DDP with lit_ddp's callbacks; and ``hang_starts``, the one line a case
adds for the zoo: it marks the moment its hang starts, for the runner's "seconds to named" column.

The process group's timeout is the one a user sets (``DDPStrategy(timeout=...)``): ``HANG_ZOO_TIMEOUT_S`` seconds,
which the runner passes (``python -m benchmarks.hang_zoo --timeout-s``). The hanging line of every case is in the
case's own file, so that the user's line a diagnosis names is that file's.
"""

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset, Sampler

from lit_ddp.callbacks import LossMonitor, StepSync

DIM = 8
LONG_S = 14.0  # healthy long work: longer than the watchdog's threshold (10 s), well within the timeout


def hang_starts() -> None:
    """Writes this moment (``time.time()``) to ``$HANG_ZOO_DIR/start-<pid>``: the runner takes the earliest."""
    folder = os.environ.get("HANG_ZOO_DIR")
    if folder:
        Path(folder, f"start-{os.getpid()}").write_text(repr(time.time()))


def timeout_s() -> float:
    return float(os.environ.get("HANG_ZOO_TIMEOUT_S", "60"))


class Rows(Dataset):
    """``rows`` rows of ``DIM`` features and their sum: any model learns it."""

    def __init__(self, rows: int = 64) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> Any:
        x = torch.full((DIM,), (i % 16) / 16)
        return x, x.sum(0, keepdim=True)


class NoPadding(Sampler):
    """A sampler of one's own that does not pad: every ``world``-th row from ``rank`` (13 rows give 7 and 6)."""

    def __init__(self, rows: int, rank: int, world: int) -> None:
        self.rows = list(range(rank, rows, world))

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def loader(rows: int = 64, **kwargs: Any) -> DataLoader:
    return DataLoader(Rows(rows), batch_size=4, **kwargs)


class Net(LightningModule):
    """A Linear regression; cases override a hook to hang it the way a thread reports."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(DIM, 1)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(callbacks: Optional[list[Callback]] = None, **kwargs: Any) -> Trainer:
    """2 CPU ranks, Lightning's ``ddp`` with the user's timeout, lit_ddp's callbacks first, then ``callbacks``."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=timeout_s())),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    settings.update(kwargs)
    return Trainer(callbacks=[LossMonitor(), StepSync(), *(callbacks or [])], **settings)
