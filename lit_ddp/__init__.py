"""lit_ddp: the notes' DDP lab experiment, ported to PyTorch Lightning and instrumented.

python -m lit_ddp.fit --devices 4
"""

import time

# `python -m lit_ddp.fit` imports this package first: a run's wall time counts from here, imports included.
STARTED = time.perf_counter()

from lit_ddp.lab.data import FixedBatchDataModule  # noqa: E402 (after STARTED, on purpose)
from lit_ddp.lab.module import LinearRegression  # noqa: E402

__all__ = ["FixedBatchDataModule", "LinearRegression"]
