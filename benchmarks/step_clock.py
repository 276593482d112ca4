"""A benchmark-only callback: each rank writes its step start times and peak RSS, like ``lit_ddp.reference``."""

import json
import resource
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback


class StepClock(Callback):
    """Records ``time.time()`` at every ``on_train_batch_start`` and at the end of training. On a GPU each mark
    waits for the GPU first, as the plain loop's ``.item()`` does every step: a run that reads nothing back
    (``configs/fast.yaml``) would otherwise queue steps ahead of the GPU and mark only the host's launch rate.

    Args:
        out_dir: Each rank writes ``out_dir/rank<r>.json``.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._mark(trainer)

    def on_train_end(self, trainer, pl_module):
        self._mark(trainer)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        path = Path(self.out_dir, f"rank{trainer.global_rank}.json")
        path.write_text(json.dumps({"step_starts": self.starts, "max_rss_mb": rss_mb}))

    def _mark(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.starts.append(time.time())
