"""The closing line of a run: ``Done: 5 steps on 2 ranks, backend gloo, device cpu, wall 3.1 s, logs in ...``.

    python -m lit_ddp.fit --devices 2

Printed by rank 0 of the ranks that trained, so it is right whichever process launched them (the ``ddp``
launcher's rank 0, torchrun, or the parent of ``ddp_fork`` ranks, which trains nothing itself).
"""

import time

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lit_ddp.callbacks.results import say


class RunSummary(Callback):
    """Rank 0 says how many steps ran on how many ranks, where, the wall time, and where the logs are.

    The wall time runs from the callback's creation, or from ``measure_from(t0)``: ``time.perf_counter()``
    of the process that launched the ranks (forked ranks share its clock).
    """

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def measure_from(self, t0: float) -> None:
        self._start = t0

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_dir = trainer.log_dir  # a broadcast: every rank must ask
        strategy = trainer.strategy
        ranks = f"{trainer.world_size} rank" + ("s" if trainer.world_size != 1 else "")
        backend = getattr(strategy, "process_group_backend", None) or "none"
        say(
            trainer,
            f"Done: {trainer.global_step} steps on {ranks}, backend {backend}, device {strategy.root_device.type}, "
            f"wall {time.perf_counter() - self._start:.1f} s, logs in {log_dir}",
        )
