"""The entry point: the notes' 5-step DDP experiment through LightningCLI.

    python -m lit_ddp.fit --devices 4
    python -m lit_ddp.fit --config configs/mini_train.yaml --trainer.max_steps 20
    python -m lit_ddp.fit --print_config
    python -m lit_ddp.fit --model my_module.MyModel --model.width 64 --data my_module.MyData  # anyone's model

``--devices N`` is a shorthand for ``--trainer.devices N``; config files are applied first, so the command line
wins; the tool's own callbacks are option groups (``--loss_monitor.*``, ``--sync_check.*``, ``--step_sync.*``,
``--checkpoint.*``). Bad input is reported as one line with exit code 2 before any rank is started. Every
option: docs/options.md.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lit_ddp
from lit_ddp.callbacks import DeviceMap, LossMonitor, RunSummary, StepSync, SyncCheck
from lit_ddp.errors import Ending, UsageError
from lit_ddp.lab.data import FixedBatchDataModule
from lit_ddp.present.end_of_fit import DETAIL_ENV
from lit_ddp.run import arguments, console, lifecycle
from lit_ddp.run.arguments import TRAINER_DEFAULTS, names_class, one_line
from lit_ddp.run.checkpointing import LastCheckpoint, checkpoint_dir, resume_path
from lit_ddp.run.run_dir import claim_version


class LitDDPCLI(LightningCLI):
    """LightningCLI with the tool's callbacks as option groups, any LightningModule (the lab's by default), and the
    lab data's width taken from the model."""

    script, module, description = "lit-ddp-fit", "lit_ddp.fit", arguments.DESCRIPTION

    @classmethod
    def prog(cls) -> str:
        """The program as it was called: the console script, or the module."""
        return cls.script if Path(sys.argv[0]).name == cls.script else f"python -m {cls.module}"

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Help lists groups in the order they are added: the tool's own come before Lightning's Trainer.
        parser.add_argument(
            "--devices",
            metavar="N",
            default=argparse.SUPPRESS,  # for --help: on the command line expand_shorthands made it --trainer.devices
            help="Shorthand for --trainer.devices N: how many processes (GPUs, or CPU processes), or 'auto'.",
        )
        # The one way the tool's callbacks reach the Trainer: option groups that LightningCLI instantiates and
        # appends to `trainer.callbacks` (a config's own `trainer.callbacks` adds to them).
        parser.add_lightning_class_args(LossMonitor, "loss_monitor")
        parser.add_lightning_class_args(DeviceMap, "device_map")
        parser.add_lightning_class_args(SyncCheck, "sync_check")
        # Before the checkpoint: a NaN or a sync error stops every rank before that step's checkpoint is written.
        parser.add_lightning_class_args(StepSync, "step_sync")
        parser.add_lightning_class_args(LastCheckpoint, "checkpoint")
        parser.add_lightning_class_args(RunSummary, "run_summary")
        parser.add_argument(
            "--detail",
            action="store_true",
            help="The end of fit prints every line, those that do not change the answer too (the ring formula, the "
            "bucket_cap note, the memory legend, the roofline's empty peak column); python -m lit_ddp.report RUN "
            "--detail does the same later.",
        )
        parser.add_argument(
            "--ckpt_path",
            type=Optional[str],
            default=None,
            help="Resume from this checkpoint; 'last': the run's last.ckpt (an error when there is none); 'auto': "
            "last.ckpt when torchrun restarted the job (--max-restarts), else start afresh.",
        )
        super().add_core_arguments_to_parser(parser)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:  # with the parser at hand: the option a mistyped one is nearest to
            # --devices is the shorthand (no default, so not among the defaults' keys)
            options = ["--devices", *(f"--{key}" for key in parser.get_defaults().keys())]
            raise UsageError(one_line(err, options)) from err

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException, ModuleNotFoundError) as err:
            # The classes' own argument checks, and Trainer's resolution of accelerator, devices and strategy
            # (Lightning raises ValueError and MisconfigurationException for those): the user's input.
            raise UsageError(one_line(err)) from err

    def __init__(self, *args, claim_log_version: bool = False, **kwargs) -> None:
        self.claim_log_version = claim_log_version
        super().__init__(*args, **kwargs)

    def before_instantiate_classes(self) -> None:
        arguments.check_devices(self.config)
        model, data = self.config.model, self.config.data
        if names_class(data.class_path, FixedBatchDataModule) and data.init_args.dim is None:  # the model's width
            data.init_args.dim = model.init_args.get("dim") if "init_args" in model else None
        if self.config.checkpoint.dirpath is None:
            self.config.checkpoint.dirpath = str(checkpoint_dir(self.config.trainer))
        if self.claim_log_version:  # a run, not a look at the config: it gets a log folder of its own
            claim_version(self.config.trainer)


def build_cli(args: list[str], claim_log_version: bool = False, cli_class: type[LitDDPCLI] = LitDDPCLI,
              **cli_kwargs: Any) -> LitDDPCLI:  # fmt: skip
    """Parses and validates ``args`` and instantiates model, data and Trainer; launches nothing. With
    ``claim_log_version``, the run's log folder is claimed first (``lit_ddp.run.run_dir``). ``cli_class`` and
    ``cli_kwargs``: another command's CLI on the same options (``lit_ddp.tune``).

    Raises:
        UsageError: For anything wrong with the command line or the config files.
    """
    try:
        options = dict(
            subclass_mode_model=True,
            subclass_mode_data=True,
            # Any LightningModule and LightningDataModule (--model my_module.MyModel, importable from the working
            # directory); the notes' task when none is named.
            args=arguments.default_classes(arguments.expand_shorthands(args), arguments.LAB_CLASSES),
            run=False,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            # The model owns its optimizer (configure_optimizers): no --optimizer to override it behind its back.
            auto_configure_optimizers=False,
            parser_kwargs=arguments.parser_kwargs(cli_class.prog(), cli_class.description),
            claim_log_version=claim_log_version,
        )
        return cli_class(LightningModule, LightningDataModule, **{**options, **cli_kwargs})
    except ArgumentError as err:  # types, ranges, unknown keys, unreadable config files
        raise UsageError(one_line(err)) from err


def cli_main(args: Optional[list[str]] = None) -> Ending:
    """Parses ``args`` (``sys.argv[1:]`` when ``None``), builds the Trainer and runs ``fit``; how it ended."""
    console.setup()
    if os.getcwd() not in sys.path and "" not in sys.path:  # the console script: --model my_module.MyModel from here
        sys.path.insert(0, os.getcwd())
    cli = build_cli(sys.argv[1:] if args is None else list(args), claim_log_version=True)
    if cli.config.detail:  # for rank 0's EndOfFit, in this process or the ranks it starts
        os.environ[DETAIL_ENV] = "1"
    hparams = {**cli.model.hparams, **cli.datamodule.hparams}
    for callback in cli.trainer.callbacks:
        if isinstance(callback, RunSummary):
            callback.measure_from(lit_ddp.STARTED)
    ckpt_path = resume_path(cli.config.ckpt_path, Path(cli.config.checkpoint.dirpath), hparams)
    with lifecycle.launcher_forwards_sigterm(cli.trainer.strategy) as forwarded:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path, weights_only=True)
    lifecycle.teardown_process_group()
    # A launching parent got SIGTERM itself (forwarded), or its StepSync holds rank 0's ending (carried back).
    return Ending.SIGTERM if forwarded else StepSync.ending_of(cli.trainer)


def main() -> None:
    code = lifecycle.exit_code(cli_main)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
