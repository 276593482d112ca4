"""Test-only callbacks for the fault tests: break one rank, or say where the ranks are. Importable by the ranks
that ``python -m lit_ddp.fit`` starts (the tests put the repo root on PYTHONPATH)."""

import os
import time

import torch
from lightning.pytorch import Callback
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class FailOnRank(Callback):
    """At ``step`` on ``rank``: ``raise`` an exception, ``exit`` hard (os._exit), or ``hang`` forever.

    Args:
        rank: The global rank that fails.
        step: The step (global_step) at which it fails.
        how: ``raise``, ``exit`` or ``hang``.
        first_attempt_only: Fail only before torchrun's first restart.
    """

    def __init__(self, rank: int = 1, step: int = 2, how: str = "raise", first_attempt_only: bool = False) -> None:
        self.rank, self.step, self.how, self.first_attempt_only = rank, step, how, first_attempt_only

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.first_attempt_only and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            return
        if self.how == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
        if self.how == "exit":
            os._exit(3)
        while True:  # hang outside any collective: the other ranks wait for this one
            time.sleep(1)


class NaNOnRank(Callback):
    """Makes ``rank``'s targets ``value`` (NaN, or an infinity) at ``step``, so its loss is that there."""

    def __init__(self, rank: int = 1, step: int = 2, value: float = float("nan")) -> None:
        self.rank, self.step, self.value = rank, step, value

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            batch[1].fill_(self.value)


class FlipOneBit(Callback):
    """After ``step``'s update, flips the lowest bit of one weight on ``rank``: the smallest non-zero bias
    element, whose change no float sum of the model can see. List it before SyncCheck."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank != self.rank or trainer.global_step - 1 != self.step:
            return
        bias = next(p for name, p in pl_module.named_parameters() if name.endswith("bias"))
        magnitudes = bias.detach().abs().masked_fill(bias.detach() == 0, float("inf"))
        with torch.no_grad():
            bias.data.view(torch.int32)[magnitudes.argmin()] ^= 1


class NudgeWeight(Callback):
    """After ``step``'s update, adds ``by`` to one weight on ``rank``: ranks apart from then on (DDP never
    re-syncs the weights). List it before SyncCheck."""

    def __init__(self, rank: int = 1, step: int = 1, by: float = 1.0) -> None:
        self.rank, self.step, self.by = rank, step, by

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step - 1 == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] += self.by


class StopAfterStep(Callback):
    """Stops training after ``step`` from the end of the callback list (after StepSync), as EarlyStopping or a Timer
    deciding after the batch: training ends with that step's gather still in flight."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer, pl_module):
        trainer.callbacks.remove(self)
        trainer.callbacks.append(self)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step - 1 == self.step:
            trainer.should_stop = True


def slow_allreduce_hook(state, bucket):
    """DDP's all-reduce after 50 ms of waiting: a bucket's all-reduce ends well after its hand-over."""
    time.sleep(0.05)
    return default_hooks.allreduce_hook(state, bucket)


class WritePid(Callback):
    """Every rank writes its pid to ``<directory>/rank<global rank>`` when training starts: how a test finds the
    ranks to signal, whichever way they were started (the ``ddp`` launcher's children, forked, torchrun's)."""

    def __init__(self, directory: str = "pids") -> None:
        self.directory = directory

    def on_train_start(self, trainer, pl_module):
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"rank{trainer.global_rank}")
        with open(f"{path}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{path}.tmp", path)  # a reader never sees a half-written pid


class OutOfMemoryOnRank(Callback):
    """At ``step`` on ``rank``, the model's forward raises ``torch.OutOfMemoryError`` (a stand-in for CUDA's, which
    is the same class): where a real one is raised, inside the training step."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            pl_module.register_forward_pre_hook(self._raise)

    def _raise(self, module, args):
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {self.rank} at step {self.step})")
