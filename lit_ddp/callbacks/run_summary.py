"""The closing line of a run: ``Done: 5 steps on 2 ranks, backend gloo, device cpu, wall 3.1 s, logs in ...``
(``, checkpoint .../last.ckpt`` when it wrote one), and, at its start, the word that it has no step limit.

    python -m lit_ddp.fit --devices 2
    python -m lit_ddp.fit --ckpt_path last     # Done: 5 steps on 2 ranks (resumed at step 5 from ...), ...
    python -m lit_ddp.fit --trainer.max_steps -1    # No step limit (max_steps=-1): 1,000 epochs of ... steps

The steps are those this run trained: a run resumed from a checkpoint (``--ckpt_path``, or Lightning's own
``hpc_ckpt_N.ckpt`` in a requeued Slurm job) counts from the checkpoint's step, and says where it resumed.

Printed by rank 0 of the ranks that trained, so it is right whichever process launched them (the ``ddp``
launcher's rank 0, torchrun, or the parent of ``ddp_fork`` ranks, which trains nothing itself).
"""

import math
import time
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lit_ddp.callbacks.shared import say
from lit_ddp.run import console
from lit_ddp.run.lean import LeanCallback


@runtime_checkable
class SavesCheckpoints(Protocol):
    """A callback that says where it last wrote a checkpoint in this fit (``LastCheckpoint``)."""

    saved: Optional[Path]


class RunSummary(LeanCallback):
    """Rank 0 says how many steps this run trained (and from which checkpoint, on a resume), on how many ranks,
    where, the wall time, and where the logs are.

    The wall time runs from the callback's creation, or from ``measure_from(t0)``: ``time.perf_counter()``
    of the process that launched the ranks (forked ranks share its clock).
    """

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._first_step = 0  # global_step when training started: the checkpoint's, on a resume

    def measure_from(self, t0: float) -> None:
        self._start = t0

    def __setstate__(self, state: dict) -> None:
        # Unpickled first thing in a ddp_spawn rank, before Lightning's start-up lines: filter them as elsewhere.
        self.__dict__.update(state)
        console.setup_in_spawned_rank()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._first_step = trainer.global_step  # the loops' state is restored before this hook
        if trainer.max_steps == -1:  # Lightning then runs max_epochs epochs (1000 when not set) without a word
            steps = trainer.estimated_stepping_batches
            epochs = f"{trainer.max_epochs:,} epoch(s)" if trainer.max_epochs != -1 else "epochs without end"
            total = f"{int(steps):,} steps" if math.isfinite(steps) else "no last step"
            say(trainer, f"No step limit (max_steps=-1): {epochs} of {trainer.num_training_batches:,} batch(es), "
                         f"{total}; --trainer.max_steps N sets one")  # fmt: skip

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_dir = trainer.log_dir  # a broadcast: every rank must ask
        strategy = trainer.strategy
        ranks = f"{trainer.world_size} rank" + ("s" if trainer.world_size != 1 else "")
        backend = getattr(strategy, "process_group_backend", None) or "none"
        resumed = f" (resumed at step {self._first_step} from {trainer.ckpt_path})" if trainer.ckpt_path else ""
        saved = next((c.saved for c in trainer.callbacks if isinstance(c, SavesCheckpoints) and c.saved), None)
        checkpoint = f", checkpoint {saved}" if saved else ""  # a run that wrote none says nothing of it
        say(
            trainer,
            f"Done: {trainer.global_step - self._first_step} steps on {ranks}{resumed}, backend {backend}, "
            f"device {strategy.root_device.type}, wall {time.perf_counter() - self._start:.1f} s, logs in {log_dir}"
            f"{checkpoint}",
        )
