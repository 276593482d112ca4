"""On SIGTERM (a preemption), write the run's ``last.ckpt`` before the job exits.

    python -m lit_ddp.fit --checkpoint_every_n_steps 100     # then: kill -TERM <pid>; resume with --ckpt_path last

Lightning turns SIGTERM into a ``SIGTERMException`` raised on every rank at the same step boundary (rank 0
broadcasts it), so saving from ``on_exception`` is safe for the collective inside ``save_checkpoint``.
Lightning's ``OnExceptionCheckpoint`` saves on *any* exception (a NaN loss or a sync error would then be
checkpointed) and deletes its file at teardown; this one saves on SIGTERM only and keeps it.
"""

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override


class PreemptionCheckpoint(Callback):
    """Saves a checkpoint to ``path`` when training is stopped by SIGTERM.

    Args:
        path: Where to write it (the run's ``last.ckpt``).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.path)
