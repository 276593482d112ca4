"""Checkpoints: one ``last.ckpt`` per run, written atomically, and the resume checkpoint checked before any
rank starts.

    python -m lit_ddp.fit --checkpoint.every_n_steps 100     # runs/mini_train/checkpoints/last.ckpt
    python -m lit_ddp.fit --ckpt_path last                   # resume from it

The checkpoint directory is a function of the config alone (``checkpoint_dir``): the logger's
``save_dir/name``, shared by all ``version_N`` log folders of a run, so a re-run finds its ``last.ckpt``.
"""

import os
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse.typing import NonNegativeInt
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lit_ddp.errors import UsageError
from lit_ddp.measure.step_marks import OptimizerSteps
from lit_ddp.run.lean import LeanCallback


def checkpoint_dir(trainer_config: Any) -> Path:
    """``<save_dir>/<name>/checkpoints`` of the configured logger, else ``<default_root_dir>/checkpoints``.

    Args:
        trainer_config: The parsed (not yet instantiated) ``trainer`` section of the config.
    """
    logger = _get(trainer_config, "logger")
    init_args = _get(logger, "init_args") if logger not in (None, False, True) else None
    save_dir, name = _get(init_args, "save_dir"), _get(init_args, "name")
    if save_dir is not None and name:
        return Path(save_dir) / name / "checkpoints"
    return Path(_get(trainer_config, "default_root_dir") or ".") / "checkpoints"


def _get(config: Any, key: str) -> Any:
    if config is None:
        return None
    return config.get(key) if hasattr(config, "get") else getattr(config, key, None)


class LastCheckpoint(LeanCallback):
    """Writes ``<dirpath>/last.ckpt`` every ``every_n_steps`` steps and at the step where training is told to stop
    (a SIGTERM).

    Lightning's ``ModelCheckpoint`` versions an existing ``last.ckpt`` to ``last-v1.ckpt`` on a re-run, and its
    ``OnExceptionCheckpoint`` saves on *any* exception (a NaN loss or a sync error would be checkpointed) and
    never in ranks that ``ddp_spawn``/``ddp_fork`` started (their exceptions skip ``on_exception``). This one
    overwrites ``last.ckpt`` and saves at the end of the step at which training is told to stop
    (``trainer.should_stop``: ``StepSync`` sets it on every rank at one step for a SIGTERM); so place it after
    ``StepSync`` (``python -m lit_ddp.fit`` does).

    Args:
        every_n_steps: Save every n optimizer steps (and on SIGTERM); 0 never saves.
        dirpath: Where ``last.ckpt`` goes; ``python -m lit_ddp.fit`` sets the run's checkpoint directory,
            elsewhere ``None`` means ``<trainer.default_root_dir>/checkpoints``.
    """

    def __init__(self, every_n_steps: NonNegativeInt = 0, dirpath: Optional[str] = None) -> None:
        if every_n_steps < 0:
            raise ValueError(f"`LastCheckpoint(every_n_steps={every_n_steps!r})` must be >= 0")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.saved: Optional[Path] = None  # where this fit last wrote last.ckpt
        self._steps = OptimizerSteps()

    def path(self, trainer: Trainer) -> Path:
        return Path(self.dirpath or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._steps.batch_start(trainer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        # Only after an optimizer step: with gradient accumulation a micro-batch's gradients are in no checkpoint.
        if not self.every_n_steps or not self._steps.ended(trainer):
            return
        if trainer.global_step % self.every_n_steps == 0 or trainer.should_stop:
            trainer.save_checkpoint(self.path(trainer))
            self.saved = self.path(trainer)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file in the target's own directory, fsyncs it, then renames it over
    the target: a process killed mid-save leaves the previous ``last.ckpt`` whole.

    Lightning's ``_atomic_save`` uses an fsspec transaction, which for local files stages the data in
    ``$TMPDIR`` and *moves* it at commit: across filesystems that is a copy into the target, not atomic.
    """

    @override
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"`AtomicCheckpointIO` takes no storage_options, got {storage_options!r}")
        target = os.fspath(path)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def resume_path(ckpt_path: Optional[str], directory: Path, hparams: dict[str, Any]) -> Optional[Path]:
    """The checkpoint ``--ckpt_path`` names, checked before any rank starts.

    Args:
        ckpt_path: A path; ``last``: the run's ``last.ckpt`` (an error when there is none); ``auto``: ``last``
            when torchrun has restarted the job, else ``None``.
        directory: The run's checkpoint directory (``checkpoint_dir``).
        hparams: The model's and data's hyperparameters from the command line.

    Raises:
        UsageError: Nothing to resume from, an unreadable checkpoint, or one whose hyperparameters disagree
            with the command line.
    """
    if ckpt_path == "auto":
        ckpt_path = "last" if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else None
    if not ckpt_path:
        return None
    path = directory / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if not path.is_file():
        hint = " (write one with --checkpoint.every_n_steps N)" if ckpt_path == "last" else ""
        raise UsageError(f"--ckpt_path {ckpt_path}: no checkpoint at {path}: nothing to resume{hint}")
    if path.stat().st_size == 0:
        raise UsageError(f"--ckpt_path: {path} is empty")
    try:
        # weights_only: a checkpoint is data; a pickle that would run code is refused, not run.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for truncated, corrupt or foreign files
        raise UsageError(f"--ckpt_path: {path} is not a readable checkpoint: {_unreadable(path, err)}") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise UsageError(f"--ckpt_path: {path} is not a Lightning checkpoint (no state_dict)")
    # The model is built from the command line; a checkpoint trained otherwise would silently win for the
    # weights and lose for the hyperparameters (lightning#20801). Refuse the mix instead.
    saved = {**checkpoint.get("hyper_parameters", {}), **checkpoint.get("datamodule_hyper_parameters", {})}
    conflicts = [
        f"{k}={saved[k]!r} in the checkpoint but {hparams[k]!r} here"
        for k in sorted(saved.keys() & hparams.keys())
        if _as_list(saved[k]) != _as_list(hparams[k])
    ]
    if conflicts:
        raise UsageError(f"--ckpt_path {path}: " + "; ".join(conflicts))
    return path


def _unreadable(path: Path, err: Exception) -> str:
    """Why ``torch.load`` failed, in a few words: torch's own message for ``weights_only`` runs to a page and
    suggests ``weights_only=False``, which is the one thing this loader will not do."""
    text = " ".join(str(err).split())
    found = re.search(r"unsupported (?:global: )?GLOBAL ([\w.]+)", text, re.I)
    if found:
        return f"it holds a Python object ({found.group(1)}); checkpoints are loaded as data only (weights_only=True)"
    if not zipfile.is_zipfile(path):
        return "not a whole file written by torch.save (no zip archive: cut short, or another format)"
    if "Weights only load failed" in text:
        return "torch.load(weights_only=True) refused it: not plain tensors and data"
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)  # c10's location prefix
    first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0][:160]
    return f"a damaged archive ({type(err).__name__}{': ' + first if first else ''})"


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value
