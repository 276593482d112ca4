"""Proof that DDP keeps every rank identical, and a loud stop when it does not.

    python -m lit_ddp.fit --devices 2 --sync_check.every_n_steps 1 --sync_check.check_grads true

At fit start: the optimizer holds the DDP-wrapped module's parameters, and all ranks start from the same weights.
After every ``every_n_steps``-th step and the last: bitwise-equal parameters on every rank, compared through a
fingerprint of the model in the step's one collective (``StepSync``); optionally, bitwise-equal gradients after
backward. On a mismatch every rank gathers the same detail and raises the same ``SyncError``, so none is left
waiting in a collective. How the fingerprint is made: docs/callbacks.md.
"""

from typing import Literal, Optional

import torch
from jsonargparse.typing import NonNegativeInt
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lit_ddp.callbacks.shared import all_gather, is_last_step, say
from lit_ddp.callbacks.step_sync import StepSync
from lit_ddp.errors import SyncError
from lit_ddp.measure.step_marks import OptimizerSteps
from lit_ddp.run.lean import LeanCallback

MAX_REPORTED = 5  # offending tensors gathered and named in one report


def flat_views(tensors: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Each tensor flattened, and its raw bits as integers (int16 for 2-byte dtypes, else int32): views of its
    storage where it is contiguous (kept from step to step, they follow its updates), copies otherwise."""
    flats = [t.reshape(-1) for t in tensors]
    return flats, [f.view(torch.int16 if f.element_size() == 2 else torch.int32) for f in flats]


def fingerprints(tensors: list[Tensor], views: Optional[tuple[list[Tensor], list[Tensor]]] = None) -> Tensor:
    """``[len(tensors), 2]`` int64: the sum of each tensor's raw bits as integers (wrapping, so exact and
    independent of reduction order; any single-bit difference changes it) and its plain float sum. ``views``: the
    tensors' ``flat_views``, kept from an earlier call: two ops a tensor then, and five for all (this runs after
    every checked step): the sums are stacked before they are cast."""
    with torch.no_grad():
        flats, bit_views = flat_views(tensors) if views is None else views
        bits = torch.stack([b.sum(dtype=torch.int32) for b in bit_views])
        # Mixed dtypes (bf16 and fp32 parameters) stack as the wider: each sum is exact in it, then in float64.
        values = torch.stack([f.sum() for f in flats]).to(torch.float64).view(torch.int64)
        return torch.stack([bits.to(torch.int64), values], dim=1)


def fingerprint_weights(n: int, device: torch.device) -> Tensor:
    """``[n, 2]`` int64: each tensor's position ``1..n`` for its bit sum, 1 for its float sum."""
    weights = torch.ones(n, 2, dtype=torch.int64, device=device)
    weights[:, 0] = torch.arange(1, n + 1, dtype=torch.int64, device=device)
    return weights


def model_fingerprint(per_tensor: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """``[2]`` int64 for all tensors at once, from their ``fingerprints``: the bit sums weighted by position (so
    that two swapped tensors differ too) and the sum of the float sums' bits, both wrapping. ``weights``: the
    caller's ``fingerprint_weights``, kept from step to step."""
    if weights is None:
        weights = fingerprint_weights(len(per_tensor), per_tensor.device)
    return (per_tensor * weights).sum(dim=0)


class SyncCheck(LeanCallback):
    """Checks that all ranks hold identical parameters (and, optionally, gradients) during training. With a
    strategy that is not DDP's (one device, ``SingleDeviceStrategy``) it stands aside with one warning.

    Args:
        every_n_steps: Check the weights after step 0, every n-th step and the last (0: the last only). Nothing
            re-syncs DDP's weights after its first broadcast, so ranks that drift apart stay apart and the next
            check names the parameters, saying when the ranks were last seen in sync. 1 checks every step (a
            one-bit difference that a later update rounds away is seen at its step only), at the cost of a pass
            over the parameters per step: about 3% of a CPU step at dim 1024 (docs/performance.md).
        check_grads: Also check the gradients after backward, before the optimizer step.
        mode: ``raise`` stops the job with ``SyncError`` on every rank; ``warn`` reports and goes on.
        check_setup: At fit start, check that the optimizer holds the DDP-wrapped module's parameters.
    """

    def __init__(
        self,
        every_n_steps: NonNegativeInt = 50,
        check_grads: bool = False,
        mode: Literal["raise", "warn"] = "raise",
        check_setup: bool = True,
    ) -> None:
        if every_n_steps < 0:
            raise ValueError(f"`SyncCheck(every_n_steps={every_n_steps!r})` must be >= 0")
        if mode not in ("raise", "warn"):
            raise ValueError(f"`SyncCheck(mode={mode!r})` must be 'raise' or 'warn'")
        self.every_n_steps = every_n_steps
        self.check_grads = check_grads
        self.mode = mode
        self.check_setup = check_setup
        self._last_checked_step: int | None = None
        self._in_sync_after: int | None = None  # the last step after which the ranks' weights were seen equal
        self._steps = OptimizerSteps()
        self._max_diff = 0.0
        self._out_of_sync = 0  # checks that found the ranks apart (mode="warn")
        self._params: Optional[list[Tensor]] = None  # the module's parameters, listed at the fit's first check
        self._weights: Optional[Tensor] = None  # model_fingerprint's positions
        self._sent: dict[int, Tensor] = {}  # step -> its per-tensor fingerprints, until its row is read
        self._viewed: list[Tensor] = []  # the trainable parameters of the last check, and their flat_views
        self._views: Optional[tuple[list[Tensor], list[Tensor]]] = None
        self.standing_aside = False  # this fit's strategy is not DDP's: nothing to compare, nothing done

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.standing_aside:
            return
        self._last_checked_step, self._in_sync_after, self._max_diff, self._out_of_sync = None, None, 0.0, 0
        self._params, self._weights, self._sent, self._viewed, self._views = None, None, {}, [], None
        if self.check_setup:
            self._check_optimizer_holds_wrapped_params(trainer)
        self._compare(trainer, pl_module, "weights", "before the first step")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if self.check_grads and not self.standing_aside:
            self._compare(trainer, pl_module, "gradients", f"at step {trainer.global_step}")

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        self.standing_aside = stage == "fit" and not isinstance(strategy, DDPStrategy)
        if self.standing_aside:
            # One line, and the other callbacks still run: a user keeps their callbacks list while on one device.
            reason = f"SyncCheck compares DDP's ranks and needs a DDP strategy, got {type(strategy).__name__}"
            rank_zero_warn(f"{reason}: it stands aside", stacklevel=5)  # Lightning's hook call: one line, as its own
            return
        self._sync = StepSync.attach(trainer, self, stage)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._steps.batch_start(trainer)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if self.standing_aside or not self._steps.ended(trainer):  # a micro-batch: nothing changed
            return
        step = trainer.global_step - 1
        last = is_last_step(trainer, batch_idx)
        if trainer.world_size == 1 or not (last or (self.every_n_steps and step % self.every_n_steps == 0)):
            return
        # One row per rank in the step's collective: the whole model's fingerprint. Only when rows differ are
        # the per-parameter fingerprints gathered, to name the parameters and ranks.
        # The per-tensor fingerprints are kept until the row is read (a step later): they name the parameters
        # that differed after *this* step, even if a one-bit difference has been rounded away since.
        if self._params is None:  # the module's parameters, once a fit (walking its modules costs every step)
            self._params = list(pl_module.parameters())
        per_tensor = fingerprints(*self._trainable())
        if self._weights is None or len(self._weights) != len(per_tensor):
            self._weights = fingerprint_weights(len(per_tensor), per_tensor.device)
        self._sent[step] = per_tensor
        self._trainer, self._module = trainer, pl_module
        row = self._sync.reserve("sync_check", 2, self._compared)  # the fingerprint's int64 bits, as float64
        torch.sum(per_tensor * self._weights, dim=0, out=row.view(torch.int64))  # model_fingerprint, into the row

    def _trainable(self) -> tuple[list[Tensor], tuple[list[Tensor], list[Tensor]]]:
        """The parameters that require grad now, and their ``flat_views``: kept while the same tensors are checked
        again and each flat view is still of its storage (a ``p.data = ...`` moves it; a tensor that is not
        contiguous has a copy there, made afresh every time)."""
        trainable = [p for p in self._params if p.requires_grad]
        viewed, views = self._viewed, self._views
        kept = (
            views is not None
            and len(viewed) == len(trainable)
            and all(
                a is b and a.data_ptr() == f.data_ptr() for a, b, f in zip(trainable, viewed, views[0], strict=True)
            )
        )
        if not kept:
            with torch.no_grad():  # plain views of the storage: no autograd view node kept with them
                self._viewed, self._views = trainable, flat_views(trainable)
        return trainable, self._views

    def _compared(self, step: int, gathered: Tensor) -> None:
        """Every rank's model fingerprint after ``step``: the same rows on every rank, so all take the same branch."""
        per_tensor = self._sent.pop(step)
        rows = gathered.view(torch.int64).tolist()  # the int64 bits the float64 columns carry, exactly
        if any(row != rows[0] for row in rows):
            self._compare(self._trainer, self._module, "weights", self._after(step), per_tensor)
        else:
            self._in_sync_after = step
        self._last_checked_step = step

    def _after(self, step: int) -> str:
        """When a check found the ranks apart: after ``step``, and after which step they were last seen alike."""
        seen = self._in_sync_after
        return f"after step {step}" + (f" (in sync after step {seen})" if seen is not None and seen < step - 1 else "")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.standing_aside or trainer.world_size == 1:
            return
        self._sync.settle(trainer)  # a check in flight, when training stopped after StepSync's batch end
        final = trainer.global_step - 1
        if final >= 0 and (self._last_checked_step is None or self._last_checked_step < final):
            # Stopped between checks (another callback's should_stop, a SIGTERM): the weights the run ends with,
            # compared now, in one collective (every rank ends at the same step).
            found = self._out_of_sync
            self._compare(trainer, pl_module, "weights", self._after(final))
            if self._out_of_sync == found:
                self._in_sync_after = final
            self._last_checked_step = final
        if self._last_checked_step is None:
            return
        n_params = sum(p.numel() for p in pl_module.parameters())
        if self._out_of_sync:  # mode="warn" went on after finding the ranks apart
            say(
                trainer,
                f"weights OUT OF SYNC across {trainer.world_size} ranks at {self._out_of_sync} check(s), last after "
                f"step {self._last_checked_step}: max |diff| = {self._max_diff:g} ({n_params:,} parameters)",
            )
            return
        say(
            trainer,
            f"weights in sync across {trainer.world_size} ranks after step {self._last_checked_step}: "
            f"max |diff| = {self._max_diff:g} ({n_params:,} parameters)",
        )

    def _compare(self, trainer: Trainer, pl_module: LightningModule, what: str, when: str,
                 local: Optional[Tensor] = None) -> None:  # fmt: skip
        """Names the tensors that differ between ranks, by their ``fingerprints`` (``local``: taken earlier, of
        the tensors as they are now otherwise), with each one's max |difference| as it is now."""
        if trainer.world_size == 1:
            return
        named = [(n, p if what == "weights" else p.grad) for n, p in pl_module.named_parameters() if p.requires_grad]
        named = [(n, t) for n, t in named if t is not None]
        local = fingerprints([t for _, t in named]) if local is None else local  # [n, 2]
        gathered = all_gather(local.flatten(), trainer.world_size)[0].view(trainer.world_size, *local.shape)
        differs = (gathered != gathered[0]).any(dim=-1)  # [world, n]: vs rank 0
        bad = differs.any(dim=0).nonzero().flatten().tolist()
        if not bad:
            return
        report = []
        for i in bad[:MAX_REPORTED]:
            name, tensor = named[i]
            flat = tensor.detach().flatten()  # the same i on every rank: no mismatch
            full = all_gather(flat, trainer.world_size)[0]
            max_diff = (full.double() - full[0].double()).abs().max().item()
            ranks = differs[:, i].nonzero().flatten().tolist()
            self._max_diff = max(self._max_diff, max_diff)
            report.append(f"{name} differs on rank(s) {ranks} from rank 0 (max |diff| = {max_diff:.3g})")
        more = f"; and {len(bad) - MAX_REPORTED} more" if len(bad) > MAX_REPORTED else ""
        message = f"{what} out of sync across {trainer.world_size} ranks {when}: " + "; ".join(report) + more
        if self.mode == "raise":
            raise SyncError(message)
        self._out_of_sync += 1
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
