"""A rank made slow on purpose, in one phase of its step, for the straggler tests; module level, so that
``ddp_spawn`` can pickle them and ``python -m lit_ddp.fit --trainer.callbacks+=...`` can name them."""

import time
from typing import Optional

from lightning.pytorch import Callback

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.lab.data import RepeatBatch


def _sleep(ms: float) -> None:
    time.sleep(ms / 1e3)


class SlowRegression(LinearRegression):
    """The notes' model; on ``slow_rank`` (every rank: None), ``delay_ms`` more in ``phase``: ``forward`` (in its
    forward), ``backward`` (in autograd, as the output's gradient arrives) or ``update`` (in the module's
    ``on_before_optimizer_step``, which Lightning calls after the callbacks', so after the update's start)."""

    def __init__(
        self, dim: int = 64, slow_rank: Optional[int] = 1, phase: str = "forward", delay_ms: float = 30.0, **kwargs
    ) -> None:
        super().__init__(dim=dim, **kwargs)  # the CLI finds the notes' model's options (lr, ...) through kwargs
        self.slow_rank, self.phase, self.delay_ms = slow_rank, phase, delay_ms

    def _slow(self, phase: str) -> bool:
        return self.phase == phase and self.slow_rank in (None, self.global_rank)

    def forward(self, x):
        if self._slow("forward"):
            _sleep(self.delay_ms)
        out = super().forward(x)
        if self._slow("backward") and out.requires_grad:
            out.register_hook(lambda grad: (_sleep(self.delay_ms), grad)[1])
        return out

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._slow("update"):
            _sleep(self.delay_ms)


class SlowBatches(RepeatBatch):
    def __init__(self, batch, length: int, delay_ms: float) -> None:
        super().__init__(batch, length)
        self.delay_ms = delay_ms

    def __iter__(self):
        for batch in super().__iter__():
            _sleep(self.delay_ms)
            yield batch


class SlowData(FixedBatchDataModule):
    """The notes' data; on ``slow_rank`` each batch takes ``fetch_ms`` to arrive (a slow input pipeline). (Not
    ``delay_ms``: Lightning refuses a model and data whose hyperparameters share a name with other values.)"""

    def __init__(self, dim: int = 64, batch_size: int = 8, slow_rank: int = 1, fetch_ms: float = 30.0) -> None:
        super().__init__(dim=dim, batch_size=batch_size)
        self.slow_rank, self.fetch_ms = slow_rank, fetch_ms

    def train_dataloader(self):
        loader = super().train_dataloader()
        if self.trainer.global_rank != self.slow_rank:
            return loader
        return SlowBatches(loader.batch, len(loader), self.fetch_ms)


class ShiftClock(Callback):
    """Moves ``rank``'s host clock (the one arrivals are marked with) ``shift_s`` ahead, as on another machine."""

    def __init__(self, rank: int = 1, shift_s: float = 100.0) -> None:
        self.rank, self.shift_s = rank, shift_s

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == self.rank:
            from lit_ddp.measure import clock

            original = clock.host_now
            clock.host_now = lambda: original() + self.shift_s


class SleepInHook(Callback):
    """On ``rank``, ``delay_ms`` in the Lightning hook ``hook`` (for the CLI, whose model is the notes')."""

    def __init__(self, rank: int = 1, hook: str = "on_before_optimizer_step", delay_ms: float = 30.0) -> None:
        self.rank, self.hook, self.delay_ms = rank, hook, delay_ms
        setattr(self, hook, self._maybe_sleep)

    def _maybe_sleep(self, trainer, *args, **kwargs):
        if trainer.global_rank == self.rank:
            _sleep(self.delay_ms)
