"""The entry point: the notes' 5-step DDP experiment through LightningCLI.

    python -m lit_ddp.fit --devices 4
    python -m lit_ddp.fit --config configs/mini_train.yaml --trainer.max_steps 20
    python -m lit_ddp.fit --print_config

``--devices N`` is a shorthand for ``--trainer.devices N``. Every ``--trainer.*``, ``--model.*`` and
``--data.*`` option of LightningCLI works; ``--model.dim`` also sets ``--data.dim``. Under the ``ddp``
launcher Lightning runs this same command again for ranks 1..N-1, so everything here runs on every rank.
"""

import logging
import sys
import time
import warnings
from typing import Optional

from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_ddp.callbacks import LossMonitor
from lit_ddp.data import FixedBatchDataModule
from lit_ddp.module import LinearRegression

log = logging.getLogger("lit_ddp.fit")  # not __name__: that is "__main__" under `python -m`

TRAINER_DEFAULTS = {
    "strategy": {"class_path": "lit_ddp.strategy.LitDDPStrategy"},
    "accelerator": "auto",
    "devices": "auto",
    "max_steps": 5,
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "mini_train"}},
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "log_every_n_steps": 1,
}


class LitDDPCLI(LightningCLI):
    """LightningCLI with the tool's always-on callbacks and ``--model.dim`` linked to the data."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(LossMonitor, "loss_monitor")
        parser.link_arguments("model.dim", "data.dim")


def _expand_shorthands(args: list[str]) -> list[str]:
    """``--devices N`` / ``--devices=N`` -> ``--trainer.devices N``."""
    out = []
    for arg in args:
        if arg == "--devices" or arg.startswith("--devices="):
            arg = arg.replace("--devices", "--trainer.devices", 1)
        out.append(arg)
    return out


def _quiet_lightning() -> None:
    """Keep the notes' output readable: Lightning's banners and the warnings that are noise for this tool."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_utilities"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # One fixed batch is the point of the experiment: no workers, no sampler, no epochs to speak of.
    for pattern in (
        ".*does not have many workers.*",
        ".*Total length of .* across ranks is zero.*",
        ".*`IterableDataset` has `__len__` defined.*",
        ".*GPU available but not used.*",
        ".*Checkpoint directory .* exists and is not empty.*",
        ".*The number of training batches .* is smaller than the logging interval.*",
        # `cli_main` always passes the (expanded) argv as `args`.
        ".*LightningCLI's args parameter is intended to run from within Python.*",
        # Lightning 2.6 against torch >= 2.10's pytree API; nothing a user can act on.
        ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def _setup_console() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    pkg = logging.getLogger("lit_ddp")
    pkg.handlers[:] = [handler]
    pkg.setLevel(logging.INFO)
    pkg.propagate = False


def cli_main(args: Optional[list[str]] = None) -> LitDDPCLI:
    """Parses ``args`` (``sys.argv[1:]`` when ``None``), builds the Trainer and runs ``fit``."""
    start = time.perf_counter()
    _quiet_lightning()
    _setup_console()
    args = _expand_shorthands(sys.argv[1:] if args is None else list(args))
    cli = LitDDPCLI(
        LinearRegression,
        FixedBatchDataModule,
        args=args,
        run=False,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    log_dir = cli.trainer.log_dir  # a broadcast: every rank must ask
    _print_closing_line(cli.trainer, time.perf_counter() - start, log_dir)
    return cli


@rank_zero_only
def _print_closing_line(trainer: Trainer, wall_s: float, log_dir: Optional[str]) -> None:
    strategy = trainer.strategy
    backend = getattr(strategy, "process_group_backend", None) or "none"
    log.info(
        f"Done: {trainer.global_step} steps on {trainer.world_size} rank{"s" if trainer.world_size != 1 else ""}, backend {backend}, "
        f"device {strategy.root_device.type}, wall {wall_s:.1f} s, logs in {log_dir}"
    )


def main() -> None:
    cli_main()


if __name__ == "__main__":
    main()
