"""A bare Lightning loop, no tool code at all: the plain loop's model, data and optimizer in a plain
``LightningModule`` under ``Trainer(strategy="ddp")``. What Lightning itself costs per step.

    python -m benchmarks.bare_lightning --devices 2 --dim 64 --steps 200 --timings OUT_DIR

``benchmarks/step_time.py`` runs it beside the plain loop (``lit_ddp.reference``) and the port. It imports
nothing of ``lit_ddp`` (``benchmarks.common`` imports none either): one ``Linear(dim, dim)``, MSE, Adam at lr
1e-3, one fixed random batch of ``--batch-size`` rows per rank, as the notes' ``mini_train.py``. Lightning's
extras that a user turns off for a lean loop are off (logger, checkpointing, progress bar, model summary), and
the batch comes from a plain iterable, not a ``DataLoader`` (the plain loop reuses one batch and loads nothing).
The only callback is ``StepClock``, the same clock the port runs under: each rank writes its step start times
to ``OUT_DIR/rank<r>.json``. Lightning's ``ddp`` launcher starts ranks 1..N-1 by running this command again.
"""

import argparse
import itertools
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import StepClock  # noqa: E402


class BareRegression(LightningModule):
    """The notes' task in a plain LightningModule: ``Linear(dim, dim)``, MSE, Adam.

    Args:
        dim: Feature width of inputs and targets.
        batch_size: Rows per rank.
        steps: Batches in the one epoch (``max_steps`` ends the run).
        lr: Adam's learning rate.
    """

    def __init__(self, dim: int, batch_size: int, steps: int, lr: float = 1e-3) -> None:
        super().__init__()
        self.layer = nn.Linear(dim, dim)
        self.dim, self.batch_size, self.steps, self.lr = dim, batch_size, steps, lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> Iterable[tuple[Tensor, Tensor]]:
        gen = torch.Generator().manual_seed(self.global_rank)  # a shard of its own on each rank
        x, y = (torch.randn(self.batch_size, self.dim, generator=gen) for _ in range(2))
        return SameBatch((x, y), self.steps)


class SameBatch:
    """``batch``, ``length`` times. (Not a list: Lightning would take a list for several dataloaders.)"""

    def __init__(self, batch: tuple[Tensor, Tensor], length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return itertools.repeat(self.batch, self.length)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bare_lightning", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="processes (or GPUs)")
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timings", required=True, help="each rank writes TIMINGS/rank<r>.json")
    args = parser.parse_args(argv)
    for name in ("devices", "dim", "batch_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.manual_seed(0)  # the same initial weights on every rank, as the plain loop (DDP broadcasts rank 0's)
    trainer = Trainer(strategy="ddp", accelerator=args.accelerator, devices=args.devices, max_steps=args.steps,
                      callbacks=[StepClock(args.timings)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(BareRegression(args.dim, args.batch_size, args.steps))
    # After the timed steps, as a careful script does: Lightning leaves gloo's process group alive, and its threads
    # can then abort the process in interpreter teardown ("terminate called without an active exception"; a run
    # of step_time.py did, which ended the whole invocation). Barrier first (pytorch#75097).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
