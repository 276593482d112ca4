"""Prints the notes' ``Step {i}, Loss {loss:.4f}`` lines with the *global* mean loss, and stops on NaN/Inf.

    python -m lit_ddp.fit --devices 2 --loss_monitor.every_n_steps 1

Each rank's ``training_step`` returns the mean over its own rows; the printed loss is the mean of those
over all ranks, i.e. the loss of the global batch, which is what a single process with the whole batch
would print. Printing needs the value on the host, so a flush is a (tiny) reduce plus a host copy; with
``check_finite`` off, losses are kept on the device and reduced ``every_n_steps`` steps at once.
"""

import logging
import math
from typing import Any

import torch
from jsonargparse.typing import NonNegativeInt
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf on at least one rank; raised on every rank at the same step."""


class LossMonitor(Callback):
    """Global-mean loss per step: printed by rank 0, logged as ``train/loss``, checked for NaN/Inf.

    Args:
        every_n_steps: Print every n-th step (and always the last one); 0 prints nothing.
        check_finite: Reduce the loss every step and, when it is NaN or Inf on any rank, raise
            ``NonFiniteLossError`` on every rank before checkpoints of that step are written.
    """

    def __init__(self, every_n_steps: NonNegativeInt = 1, check_finite: bool = True) -> None:
        if every_n_steps < 0:
            raise ValueError(f"`LossMonitor(every_n_steps={every_n_steps!r})` must be >= 0")
        self.every_n_steps = every_n_steps
        self.check_finite = check_finite
        self._pending: list[tuple[int, Tensor]] = []  # (step, local loss) not yet reduced

    def _due(self, trainer: Trainer, step: int) -> bool:
        return bool(self.every_n_steps) and (step % self.every_n_steps == 0 or _is_last_step(trainer))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if not self.every_n_steps and not self.check_finite:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        step = trainer.global_step - 1  # the optimizer step has already advanced global_step
        self._pending.append((step, loss.detach().float().clone()))
        if self.check_finite or _is_last_step(trainer) or len(self._pending) >= self.every_n_steps:
            self._flush(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending:
            self._flush(trainer)

    def _flush(self, trainer: Trainer) -> None:
        steps = [s for s, _ in self._pending]
        local = torch.stack([loss for _, loss in self._pending])
        self._pending = []
        global_mean = trainer.strategy.reduce(local.clone(), reduce_op="mean").tolist()
        for step, value in zip(steps, global_mean, strict=True):
            if not math.isfinite(value):
                # Every rank holds the same reduced value, so every rank takes this branch together.
                ranks = _nonfinite_ranks(trainer, local[steps.index(step)])
                raise NonFiniteLossError(
                    f"loss is {value} at step {step}: non-finite on rank(s) {ranks}; training stopped"
                )
            if self._due(trainer, step):
                if trainer.is_global_zero:
                    log.info(f"Step {step}, Loss {value:.4f}")
                    if trainer.logger is not None:
                        trainer.logger.log_metrics({"train/loss": value}, step=step)


def _is_last_step(trainer: Trainer) -> bool:
    return trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps


def _nonfinite_ranks(trainer: Trainer, local_loss: Tensor) -> list[int]:
    flags = trainer.strategy.all_gather(~torch.isfinite(local_loss))
    return [rank for rank, bad in enumerate(flags.reshape(-1).tolist()) if bad]
