"""The tool's callbacks in a script of your own: a plain ``Trainer``, Lightning's own DDP strategy, a model that
is not the tool's (Lightning's demo Transformer on random tokens, SGD).

    python examples/own_module.py                # 2 CPU ranks, strategy="ddp"
    python examples/own_module.py --devices 1    # one process: CommMonitor and SyncCheck stand aside
    python -m lit_ddp.tune --model examples.own_module.RandomTokens --data examples.own_module.RandomTokenData

What it prints, and where the record goes: docs/callbacks.md.
"""

import argparse

import torch
from lightning.pytorch import LightningDataModule, Trainer, seed_everything
from lightning.pytorch.demos import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

import lit_ddp
from lit_ddp import CommMonitor, DeviceMap, PhaseTimer, SyncCheck


class RandomTokens(LightningTransformer):
    def prepare_data(self) -> None:  # the demo downloads WikiText2 here; random tokens need nothing
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RandomTokenData(LightningDataModule):
    """Random tokens in batches of ``batch_size`` sequences of ``length`` (the model predicts the next token)."""

    def __init__(self, batch_size: int = 8, length: int = 16, vocab_size: int = 1000, rows: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        tokens = torch.randint(0, vocab_size, (rows, length + 1), generator=torch.Generator().manual_seed(0))
        self.dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    lit_ddp.quiet_lightning()  # Lightning's start-up lines and unactionable warnings hidden, as the CLI hides them
    seed_everything(0)
    tokens = torch.randint(0, 1000, (64, 17))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=4,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[PhaseTimer(), CommMonitor(), SyncCheck(), DeviceMap()],
    )
    trainer.fit(RandomTokens(vocab_size=1000), data)


if __name__ == "__main__":
    main()
