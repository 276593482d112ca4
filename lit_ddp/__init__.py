"""lit_ddp: the notes' DDP lab experiment, ported to PyTorch Lightning and instrumented.

python -m lit_ddp.fit --devices 4
"""

from lit_ddp.data import FixedBatchDataModule
from lit_ddp.module import LinearRegression

__all__ = ["FixedBatchDataModule", "LinearRegression"]
