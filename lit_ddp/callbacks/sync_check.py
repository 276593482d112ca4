"""Proof that DDP keeps every rank identical, and a loud stop when it does not.

    python -m lit_ddp.fit --devices 2 --sync_check.every_n_steps 1 --sync_check.check_grads true

At fit start: the optimizer holds exactly the DDP-wrapped module's parameters (the notes' "optimizer after
wrapping" pitfall), the device map is printed with its pitfalls, and all ranks start from the same weights
(DDP's initial broadcast). After every ``every_n_steps``-th step and the last: all ranks hold bitwise-equal
parameters. Optionally, after backward: bitwise-equal gradients (the all-reduce happened).

A check costs one pass over the parameters and one small all-gather: two fingerprints per parameter (the
wrapping integer sum of its raw bits, which any single-bit difference changes, and its float sum). Only on
a mismatch are the offending tensors gathered, for the report. Every rank takes the same decision from the
same gathered data, so every rank raises the same ``SyncError`` and none is left waiting in a collective.
"""

import logging
from typing import Literal

import torch
import torch.distributed as dist
from jsonargparse.typing import PositiveInt
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lit_ddp import device_map

log = logging.getLogger(__name__)

MAX_REPORTED = 5  # offending tensors gathered and named in one report


class SyncError(RuntimeError):
    """Ranks hold different parameters or gradients; raised on every rank at once."""


def fingerprints(tensors: list[Tensor]) -> Tensor:
    """``[len(tensors), 2]`` int64: the sum of each tensor's raw bits as integers (wrapping, so exact and
    independent of reduction order; any single-bit difference changes it) and its plain float sum."""
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        bits = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)
        bit_sum = bits.sum(dtype=torch.int32).to(torch.int64)
        value_sum = flat.sum().to(torch.float64).view(torch.int64)
        rows.append(torch.stack([bit_sum, value_sum]))
    return torch.stack(rows)


class SyncCheck(Callback):
    """Checks that all ranks hold identical parameters (and, optionally, gradients) during training.

    Args:
        every_n_steps: Check the weights after every n-th step; the last step is always checked.
        check_grads: Also check the gradients after backward, before the optimizer step.
        mode: ``raise`` stops the job with ``SyncError`` on every rank; ``warn`` reports and goes on.
        check_setup: At fit start, check the optimizer/DDP parameter identity and print the device map.
    """

    def __init__(
        self,
        every_n_steps: PositiveInt = 1,
        check_grads: bool = False,
        mode: Literal["raise", "warn"] = "raise",
        check_setup: bool = True,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"`SyncCheck(every_n_steps={every_n_steps!r})` must be >= 1")
        if mode not in ("raise", "warn"):
            raise ValueError(f"`SyncCheck(mode={mode!r})` must be 'raise' or 'warn'")
        self.every_n_steps = every_n_steps
        self.check_grads = check_grads
        self.mode = mode
        self.check_setup = check_setup
        self._last_checked_step: int | None = None
        self._max_diff = 0.0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.check_setup:
            self._check_optimizer_holds_wrapped_params(trainer)
            self._print_device_map(trainer)
        self._compare(trainer, pl_module, "weights", "before the first step")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if self.check_grads:
            self._compare(trainer, pl_module, "gradients", f"at step {trainer.global_step}")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1
        last = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        if last or step % self.every_n_steps == 0:
            self._compare(trainer, pl_module, "weights", f"after step {step}")
            self._last_checked_step = step

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last_checked_step is None or not trainer.is_global_zero:
            return
        n_params = sum(p.numel() for p in pl_module.parameters())
        log.info(
            f"weights in sync across {trainer.world_size} ranks after step {self._last_checked_step}: "
            f"max |diff| = {self._max_diff:g} ({n_params:,} parameters)"
        )

    def _compare(self, trainer: Trainer, pl_module: LightningModule, what: str, when: str) -> None:
        if trainer.world_size == 1:
            return
        named = [(n, p if what == "weights" else p.grad) for n, p in pl_module.named_parameters() if p.requires_grad]
        named = [(n, t) for n, t in named if t is not None]
        gathered = trainer.strategy.all_gather(fingerprints([t for _, t in named]))  # [world, n, 2]
        differs = (gathered != gathered[0]).any(dim=-1)  # [world, n]: vs rank 0
        bad = differs.any(dim=0).nonzero().flatten().tolist()
        if not bad:
            return
        report = []
        for i in bad[:MAX_REPORTED]:
            name, tensor = named[i]
            full = trainer.strategy.all_gather(tensor.detach().contiguous())  # same i on every rank: no mismatch
            max_diff = (full.double() - full[0].double()).abs().max().item()
            ranks = differs[:, i].nonzero().flatten().tolist()
            self._max_diff = max(self._max_diff, max_diff)
            report.append(f"{name} differs on rank(s) {ranks} from rank 0 (max |diff| = {max_diff:.3g})")
        more = f"; and {len(bad) - MAX_REPORTED} more" if len(bad) > MAX_REPORTED else ""
        message = f"{what} out of sync across {trainer.world_size} ranks {when}: " + "; ".join(report) + more
        if self.mode == "raise":
            raise SyncError(message)
        rank_zero_warn(message)

    def _check_optimizer_holds_wrapped_params(self, trainer: Trainer) -> None:
        wrapped = trainer.strategy.model
        module_params = {id(p) for p in getattr(wrapped, "module", wrapped).parameters()}
        opt_params = [p for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]]
        stray = sum(id(p) not in module_params for p in opt_params)
        # A local decision, but identical on every rank: the same code built the same objects everywhere.
        if stray:
            raise SyncError(
                f"the optimizer holds {stray} tensor(s) that are not parameters of the DDP-wrapped module: "
                "it was created before wrapping, and DDP's broadcast and all-reduce never reach it"
            )

    def _print_device_map(self, trainer: Trainer) -> None:
        row = device_map.this_rank(
            trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.strategy.root_device
        )
        rows: list = [None] * trainer.world_size
        if dist.is_available() and dist.is_initialized():
            dist.all_gather_object(rows, row)
        else:
            rows = [row]
        if trainer.is_global_zero:
            log.info(device_map.format_table(rows))
            for problem in device_map.problems(rows):
                rank_zero_warn(f"device map: {problem}")
