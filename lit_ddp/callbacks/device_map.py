"""Which rank runs on which device, printed once at fit start, with the notes' device-indexing pitfalls.

    python -m lit_ddp.fit --devices 2

The rules (two ranks on one GPU, ``CUDA_VISIBLE_DEVICES`` and ``device_ids`` mixed, ``SLURM_LOCALID`` !=
``LOCAL_RANK``) live in ``lit_ddp.measure.placement`` and are tested on hand-made maps there.
"""

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_ddp.callbacks.shared import exit_cleanly, gather_to_zero, say
from lit_ddp.measure import placement
from lit_ddp.run.lean import LeanCallback


class DeviceMap(LeanCallback):
    """Rank 0 prints a table of every rank's host, device and device-related environment at fit start, and
    warns about placements that skew device indexing."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        exit_cleanly(trainer)
        row = placement.this_rank(
            trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.strategy.root_device
        )
        rows = gather_to_zero(trainer, row)  # small dicts of strings, once per fit
        if rows is not None:
            say(trainer, placement.format_table(rows))
            for problem in placement.problems(rows):
                rank_zero_warn(f"device map: {problem}")
