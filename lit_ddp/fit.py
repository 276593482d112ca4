"""The entry point: the notes' 5-step DDP experiment through LightningCLI.

    python -m lit_ddp.fit --devices 4
    python -m lit_ddp.fit --config configs/mini_train.yaml --trainer.max_steps 20
    python -m lit_ddp.fit --print_config

``--devices N`` is a shorthand for ``--trainer.devices N``. Config files are applied first, so options on
the command line win over them wherever they are written. Every ``--trainer.*``, ``--model.*`` and
``--data.*`` option of LightningCLI works; ``--model.dim`` also sets ``--data.dim``. Under the ``ddp``
launcher Lightning runs this same command again for ranks 1..N-1, so everything here runs on every rank.
Bad input is reported as one line with exit code 2 before any rank is started.
"""

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse import ArgumentError
from jsonargparse.typing import NonNegativeInt
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_ddp.callbacks import LossMonitor, NonFiniteLossError, SyncError
from lit_ddp.callbacks.preemption import PreemptionCheckpoint
from lit_ddp.data import FixedBatchDataModule
from lit_ddp.module import LinearRegression

log = logging.getLogger("lit_ddp.fit")  # not __name__: that is "__main__" under `python -m`

TRAINER_DEFAULTS = {
    "strategy": {"class_path": "lit_ddp.strategy.LitDDPStrategy"},
    "accelerator": "auto",
    "devices": "auto",
    "max_steps": 5,
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs", "name": "mini_train"},
    },
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "log_every_n_steps": 1,
    # Where config.yaml goes when there is no logger (`--trainer.logger false`): not the working directory.
    "default_root_dir": "runs",
}


class UsageError(Exception):
    """Bad command line or config: reported as one line with exit code 2, before any rank is started."""


class LitDDPCLI(LightningCLI):
    """LightningCLI with the tool's always-on callbacks and ``--model.dim`` linked to the data."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(LossMonitor, "loss_monitor")
        parser.add_argument(
            "--checkpoint_every_n_steps",
            type=NonNegativeInt,
            default=0,
            help="Write <run>/checkpoints/last.ckpt every N steps (0: no checkpoints). <run> is the logger's "
            "save_dir/name (runs/mini_train by default), the same for every version of the run.",
        )
        parser.add_argument(
            "--ckpt_path",
            type=Optional[str],
            default=None,
            help="Resume from this checkpoint; 'last': the run's last.ckpt (an error when there is none); 'auto': "
            "last.ckpt when torchrun restarted the job (--max-restarts), else start afresh.",
        )
        parser.link_arguments("model.dim", "data.dim")
        # A parsed default (unlike `trainer_defaults`, which always appends): a config's `trainer.callbacks`
        # replaces it, `--trainer.callbacks+=X` adds to it, `--trainer.callbacks=[]` turns it off.
        parser.set_defaults({"trainer.callbacks": [{"class_path": "lit_ddp.callbacks.SyncCheck"}]})

    def before_instantiate_classes(self) -> None:
        _check_devices(self.config.trainer.accelerator, self.config.trainer.devices)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        self.checkpoint_dir = _run_root(trainer_config) / "checkpoints"
        every = self.config.checkpoint_every_n_steps
        if every:
            last_only = ModelCheckpoint(
                dirpath=self.checkpoint_dir,
                save_last=True,
                save_top_k=0,
                every_n_train_steps=every,
                enable_version_counter=False,  # a re-run overwrites last.ckpt; never last-v1.ckpt
            )
            on_sigterm = PreemptionCheckpoint(str(self.checkpoint_dir / "last.ckpt"))
            kwargs["callbacks"] = [*(trainer_config.get("callbacks") or []), last_only, on_sigterm]
            kwargs["enable_checkpointing"] = True
        return super().instantiate_trainer(**kwargs)

    def checkpoint_to_resume(self) -> Optional[Path]:
        """The checkpoint ``--ckpt_path`` names, checked before any rank starts.

        Raises:
            UsageError: Nothing to resume from, an unreadable checkpoint, or one whose hyperparameters
                disagree with the command line.
        """
        ckpt = self.config.ckpt_path
        if ckpt == "auto":
            ckpt = "last" if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else None
        if not ckpt:
            return None
        path = self.checkpoint_dir / "last.ckpt" if ckpt == "last" else Path(ckpt)
        if not path.is_file():
            hint = " (write one with --checkpoint_every_n_steps N)" if ckpt == "last" else ""
            raise UsageError(f"--ckpt_path {ckpt}: no checkpoint at {path}: nothing to resume{hint}")
        if path.stat().st_size == 0:
            raise UsageError(f"--ckpt_path: {path} is empty")
        try:
            # weights_only: a checkpoint is data; a pickle that would run code is refused, not run.
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises many types for truncated, corrupt or foreign files
            reason = " ".join(str(err).split())[:200] or type(err).__name__
            raise UsageError(f"--ckpt_path: {path} is not a readable checkpoint: {reason}") from err
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise UsageError(f"--ckpt_path: {path} is not a Lightning checkpoint (no state_dict)")
        # The model is built from the command line; a checkpoint trained otherwise would silently win for
        # the weights and lose for the hyperparameters (Lightning #20801). Refuse the mix instead.
        saved = {**checkpoint.get("hyper_parameters", {}), **checkpoint.get("datamodule_hyper_parameters", {})}
        now = {**self.model.hparams, **self.datamodule.hparams}
        conflicts = [
            f"{k}={saved[k]!r} in the checkpoint but {now[k]!r} here"
            for k in sorted(saved.keys() & now.keys())
            if _normalise(saved[k]) != _normalise(now[k])
        ]
        if conflicts:
            raise UsageError(f"--ckpt_path {path}: " + "; ".join(conflicts))
        return path


def _run_root(trainer_config: dict) -> Path:
    """The run's directory, shared by all its versions: the logger's save_dir/name, or default_root_dir."""
    logger = trainer_config.get("logger")
    if getattr(logger, "root_dir", None):
        return Path(logger.root_dir)
    return Path(trainer_config.get("default_root_dir") or ".")


def _normalise(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value


def _check_devices(accelerator: Any, devices: Any) -> None:
    """Name the option in the errors that Lightning reports without it."""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UsageError(f"--trainer.accelerator {accelerator}: no CUDA GPU is visible on this machine")
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and (devices == 0 or devices < -1 or (devices == -1 and not on_gpu)):
        allowed = "a positive number of processes" + (", -1 (all GPUs)" if on_gpu else "") + " or 'auto'"
        raise UsageError(f"--trainer.devices must be {allowed}, got {devices}")
    if isinstance(devices, str) and devices != "auto" and not all(p.strip().isdigit() for p in devices.split(",")):
        raise UsageError(f"--trainer.devices must be a number, a list of GPU indices or 'auto', got {devices!r}")


def _expand_shorthands(args: list[str]) -> list[str]:
    """``--devices N`` -> ``--trainer.devices N``, and every ``--config`` first.

    jsonargparse applies arguments in order, so ``--devices 2 --config X.yaml`` would let the file's
    ``devices`` silently win. Moving the config files (in their own order) ahead of everything else makes
    explicit options beat config files wherever they are written.
    """
    configs, rest, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" and i + 1 < len(args):
            configs += args[i : i + 2]
            i += 2
            continue
        if arg.startswith("--config="):
            configs.append(arg)
        elif arg == "--devices" or arg.startswith("--devices="):
            rest.append(arg.replace("--devices", "--trainer.devices", 1))
        else:
            rest.append(arg)
        i += 1
    return configs + rest


def _quiet_lightning() -> None:
    """Keep the notes' output readable: Lightning's banners and the warnings that are noise for this tool."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_utilities"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # But not the child observer's "Child process with PID ... terminated with code ...": it names the rank.
    logging.getLogger("lightning.fabric.strategies.launchers.subprocess_script").setLevel(logging.INFO)
    for pattern in (
        # One fixed batch is the point of the experiment: no workers, no sampler, no epochs to speak of.
        ".*does not have many workers.*",
        ".*Total length of .* across ranks is zero.*",
        ".*GPU available but not used.*",
        ".*Checkpoint directory .* exists and is not empty.*",
        ".*The number of training batches .* is smaller than the logging interval.*",
        # `cli_main` always passes the (expanded) argv as `args`.
        ".*LightningCLI's args parameter is intended to run from within Python.*",
        # Lightning 2.6 against newer torch's pytree and collectives APIs; nothing a user can act on.
        ".*torch.distributed.nn.functional.all_gather is deprecated.*",
        r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def _setup_console() -> None:
    """The tool's own lines (``lit_ddp.*`` loggers) go to stdout, bare, as the notes print them."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    pkg = logging.getLogger("lit_ddp")
    pkg.handlers[:] = [handler]
    pkg.setLevel(logging.INFO)
    pkg.propagate = False


def build_cli(args: list[str]) -> LitDDPCLI:
    """Parses and validates ``args`` and instantiates model, data and Trainer; launches nothing.

    Raises:
        UsageError: For anything wrong with the command line or the config files.
    """
    try:
        return LitDDPCLI(
            LinearRegression,
            FixedBatchDataModule,
            args=_expand_shorthands(args),
            run=False,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            # The model owns its optimizer (configure_optimizers): no --optimizer to override it behind its back.
            auto_configure_optimizers=False,
            parser_kwargs={"exit_on_error": False},
        )
    except UsageError:
        raise
    except (ArgumentError, MisconfigurationException, ValueError, TypeError) as err:
        # The parser validated types and ranges; what is left comes from the classes' own checks and from
        # Trainer's accelerator/devices/strategy resolution: the user's input, not our bug.
        if os.environ.get("LIT_DDP_DEBUG"):
            raise
        raise UsageError(" ".join(line.strip() for line in str(err).splitlines() if line.strip())) from err


def cli_main(args: Optional[list[str]] = None) -> LitDDPCLI:
    """Parses ``args`` (``sys.argv[1:]`` when ``None``), builds the Trainer and runs ``fit``."""
    start = time.perf_counter()
    _quiet_lightning()
    _setup_console()
    cli = build_cli(sys.argv[1:] if args is None else list(args))
    ckpt_path = cli.checkpoint_to_resume()
    _sigterm_without_collectives(cli.trainer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path, weights_only=True)
    log_dir = cli.trainer.log_dir  # a broadcast: every rank must ask
    _print_closing_line(cli.trainer, time.perf_counter() - start, log_dir)
    if torch.distributed.is_initialized():
        # Lightning leaves the process group alive, and gloo's threads then die in interpreter teardown
        # ("terminate called without an active exception", SIGABRT, seen under torchrun). Every rank is past
        # its last collective: destroy the group while everything is still alive (pytorch#75097: barrier first).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return cli


def _sigterm_without_collectives(trainer: Trainer) -> None:
    """Lightning's SIGTERM handler broadcasts from inside the signal handler; when the signal lands while the
    main thread waits in another collective the two interleave and the ranks hang until the timeout (seen
    here, 1 SIGTERM in 4). Keep the rest: forward the signal to the launched ranks and set the flag, which
    the training loop broadcasts from rank 0 at the next step boundary, so every rank stops at the same step.
    """
    connector = trainer._signal_connector

    def notify(signum, frame) -> None:
        if not connector.received_sigterm and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = notify


@rank_zero_only
def _print_closing_line(trainer: Trainer, wall_s: float, log_dir: Optional[str]) -> None:
    strategy = trainer.strategy
    backend = getattr(strategy, "process_group_backend", None) or "none"
    ranks = f"{trainer.world_size} rank" + ("s" if trainer.world_size != 1 else "")
    log.info(
        f"Done: {trainer.global_step} steps on {ranks}, backend {backend}, device {strategy.root_device.type}, "
        f"wall {wall_s:.1f} s, logs in {log_dir}"
    )


def main() -> None:
    try:
        cli_main()
    except UsageError as err:
        print(f"lit-ddp-fit: error: {err}", file=sys.stderr)
        sys.exit(2)
    except SIGTERMException:
        # Lightning's SIGTERMException subclasses SystemExit with no code, i.e. exit 0: a preempted job
        # would look like a finished one. 128 + SIGTERM is what a shell reports for a terminated process.
        print("lit-ddp-fit: stopped by SIGTERM", file=sys.stderr)
        sys.exit(143)
    except (SyncError, NonFiniteLossError) as err:
        # Raised on every rank at the same step; one report is enough.
        if rank_zero_only.rank == 0:
            print(f"lit-ddp-fit: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
