"""Which rank runs on which device, printed once at fit start, with the notes' device-indexing pitfalls.

    python -m lit_ddp.fit --devices 2

The rules (two ranks on one GPU, ``CUDA_VISIBLE_DEVICES`` and ``device_ids`` mixed, ``SLURM_LOCALID`` !=
``LOCAL_RANK``) live in ``lit_ddp.placement`` and are tested on hand-made maps there.
"""

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_ddp import placement
from lit_ddp.callbacks.results import say


class DeviceMap(Callback):
    """Rank 0 prints a table of every rank's host, device and device-related environment at fit start, and
    warns about placements that skew device indexing."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        row = placement.this_rank(
            trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.strategy.root_device
        )
        rows: list = [row]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            rows = [None] * trainer.world_size
            dist.all_gather_object(rows, row)  # small dicts of strings, once per fit
        say(trainer, placement.format_table(rows))
        if trainer.is_global_zero:
            for problem in placement.problems(rows):
                rank_zero_warn(f"device map: {problem}")
