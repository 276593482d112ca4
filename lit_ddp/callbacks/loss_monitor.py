"""Prints the notes' ``Step {i}, Loss {loss:.4f}`` lines with the *global* mean loss, and stops on NaN/Inf.

    python -m lit_ddp.fit --devices 2 --loss_monitor.every_n_steps 1

The printed loss is the mean over all ranks of each rank's own mean: the loss of the global batch, as a single
process with the whole batch would print it. It travels in the step's one collective (``StepSync``): every step
with ``check_finite``, else only on the steps that print. With gradient accumulation a step's line carries the
mean loss of its micro-batches; under ``16-mixed`` a step whose update the grad scaler skipped says so.
docs/callbacks.md; a step: docs/architecture.md.
"""

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from jsonargparse.typing import NonNegativeInt
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from lit_ddp.callbacks.shared import grad_scaler, is_last_step, line_printer, log_metrics
from lit_ddp.callbacks.step_sync import StepSync
from lit_ddp.errors import NonFiniteLossError
from lit_ddp.measure.step_marks import OptimizerSteps, Updates
from lit_ddp.run.lean import LeanCallback


class LossMonitor(LeanCallback):
    """Global-mean loss per step: printed by rank 0, logged as ``train/loss``, checked for NaN/Inf.

    Args:
        every_n_steps: Print every n-th step (and always the last one); 0 prints nothing; None (the default)
            the Trainer's ``log_every_n_steps``, Lightning's cadence for step metrics (50 unless set; the CLI sets 1).
        check_finite: Gather the loss every step and, when it is NaN or Inf on any rank, raise
            ``NonFiniteLossError`` on every rank at that step (before checkpoints of that step are written).
    """

    def __init__(self, every_n_steps: Optional[NonNegativeInt] = None, check_finite: bool = True) -> None:
        if every_n_steps is not None and every_n_steps < 0:
            raise ValueError(f"`LossMonitor(every_n_steps={every_n_steps!r})` must be >= 0")
        self.every_n_steps = every_n_steps
        self._every = every_n_steps or 0  # what this fit prints by: every_n_steps, or the Trainer's cadence
        self.check_finite = check_finite
        self._sync: StepSync | None = None
        self._losses: list[Tensor] = []  # the running optimizer step's micro-batch losses
        self._steps = OptimizerSteps()
        self._handles: list[Any] = []
        self._updates = Updates()
        self._print: Callable[[str], None] = print  # rank 0's line printer, chosen at the start of training
        self._logged: list[tuple[int, float]] = []  # (step, global mean loss) for the loggers, given in batches

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._sync = StepSync.attach(trainer, self, stage)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._losses, self._updates, self._logged = [], Updates(), []
        self._every = trainer.log_every_n_steps if self.every_n_steps is None else self.every_n_steps
        self._print = line_printer(trainer)
        self._trainer = trainer
        if grad_scaler(trainer) is not None:  # 16-mixed: each optimizer's step tells a skipped update (Updates)
            self._handles = [opt.register_step_post_hook(self._on_step_end) for opt in trainer.optimizers]

    def _on_step_end(self, optimizer, args, kwargs) -> None:
        self._updates.ran(optimizer)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._updates.begin()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._steps.batch_start(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._sync is not None:  # the last step's line and row, when training stopped with its gather in flight
            self._sync.settle(trainer)
        self.on_exception(trainer, pl_module, None)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._log(trainer)

    def _log(self, trainer: Trainer) -> None:
        """The rows kept for the loggers, each at its step: every ``log_every_n_steps`` printed steps (Lightning's
        own cadence for step metrics) and at the end of training, not in the step."""
        logged, self._logged = self._logged, []
        for step, loss in logged:
            log_metrics(trainer, {"train/loss": loss}, step=step)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if not (self._every or self.check_finite):  # nothing to print or check on any step: no loss kept
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            # Automatic optimization hands over the loss divided by accumulate_grad_batches (what backward got).
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            loss = loss.detach()  # as it is, in its dtype: the row is float64, and a copy into it is exact
            self._losses.append(loss.float() * scale if scale != 1 else loss)
        if not self._steps.ended(trainer):  # a micro-batch of the running step
            return
        step = trainer.global_step - 1  # the optimizer step has already advanced global_step
        losses, self._losses = self._losses, []
        skipped = self._updates.skipped() if grad_scaler(trainer) is not None else False  # resets it for the next
        due = bool(self._every) and (step % self._every == 0 or is_last_step(trainer, batch_idx))
        if not (due or self.check_finite) or not losses:
            return
        # One micro-batch: its loss as it is (exact in StepSync's float64 row, a NaN or an Inf stays one, so the
        # gathered losses are the NaN check); several: the float32 mean of them.
        local = losses[0] if len(losses) == 1 else torch.stack(losses).float().mean()
        on_result = self._report if due else self._global_mean
        # A fused optimizer's skip is a flag on the device: it travels in the row, read once gathered (no sync here).
        # Without a grad scaler no update is ever skipped: the loss travels alone.
        if grad_scaler(trainer) is None:
            self._sync.reserve("loss", 1, on_result).copy_(local)  # into the step's row: one copy, no other kernel
            return
        flag = skipped.to(local) if isinstance(skipped, Tensor) else local.new_full((1,), float(skipped))
        self._sync.put("loss", torch.cat([local.float().reshape(1), flag.float().reshape(1)]), on_result)

    def _global_mean(self, step: int, gathered: Tensor) -> float:
        """The global mean loss of ``step`` from every rank's row (``[world_size, 1 or 2]``: the loss, then whether
        the grad scaler skipped the update); NaN or Inf on any rank raises on every rank, which all see the same
        rows, at this step."""
        losses = gathered[:, 0].tolist()
        global_mean = sum(losses) / len(losses)
        if not all(map(math.isfinite, losses)):
            bad = [rank for rank, value in enumerate(losses) if not math.isfinite(value)]
            raise NonFiniteLossError(f"loss is {global_mean} at step {step}: non-finite on rank(s) {bad}; training "
                                     "stopped")  # fmt: skip
        return global_mean

    def _report(self, step: int, gathered: Tensor) -> None:
        """A printed step: its line, from values on the host, and its row for the loggers, kept for ``_log``."""
        global_mean = self._global_mean(step, gathered)
        skipped = gathered.shape[1] > 1 and gathered[0, 1].item()
        note = " (update skipped: the grad scaler found inf/NaN gradients)" if skipped else ""
        self._print(f"Step {step}, Loss {global_mean:.4f}{note}")
        self._logged.append((step, global_mean))
        if len(self._logged) >= self._trainer.log_every_n_steps:
            self._log(self._trainer)
