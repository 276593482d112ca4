"""Test-only callbacks that record what a ``ddp_spawn`` rank sees (the test process sees only rank 0's
weights): its logs and warnings, DDP's own bucket sizes."""

import json
import logging
from pathlib import Path

from lightning.pytorch import Callback

from lit_ddp._torch import ddp_logging_data


class RecordLogs(Callback):
    """Appends what Lightning's logging (``rank_zero_info``) and ``warnings`` (``rank_zero_warn``) say during
    fit to ``<out_dir>/rank<r>.log``, from every rank: the test process cannot see a ``ddp_spawn`` worker's
    logs or warnings."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)

    def setup(self, trainer, pl_module, stage):
        handler = logging.FileHandler(self.out_dir / f"rank{trainer.global_rank}.log")
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.captureWarnings(True)  # warnings -> the "py.warnings" logger
        for name in ("lightning.pytorch", "py.warnings"):
            logging.getLogger(name).addHandler(handler)

    @staticmethod
    def read(out_dir: Path, rank: int) -> str:
        return (Path(out_dir) / f"rank{rank}.log").read_text()


class RecordDDPBuckets(Callback):
    """Writes DDP's own bucket sizes (its logging data) from rank 0."""

    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            data = ddp_logging_data(trainer.strategy.model)
            sizes = {k: [int(v) for v in str(data[k]).split(",")] for k in ("bucket_sizes", "rebuilt_bucket_sizes")
                     if k in data}  # fmt: skip
            self.out.write_text(json.dumps(sizes))
