"""lit_ddp: the notes' DDP lab experiment, ported to PyTorch Lightning and instrumented.

python -m lit_ddp.fit --devices 4
"""

import time

# `python -m lit_ddp.fit` imports this package first: a run's wall time counts from here, imports included.
STARTED = time.perf_counter()

_LAB = {"FixedBatchDataModule": "lit_ddp.lab.data", "LinearRegression": "lit_ddp.lab.module"}
__all__ = list(_LAB)


def __getattr__(name: str):
    """The lab's classes, imported on first use: the commands that only read records (report, forecast, the probe)
    start without Lightning (seconds of its import)."""
    if name in _LAB:
        import importlib

        return getattr(importlib.import_module(_LAB[name]), name)
    raise AttributeError(f"module 'lit_ddp' has no attribute {name!r}")
