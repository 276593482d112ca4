"""lit_ddp: the notes' DDP lab experiment, ported to PyTorch Lightning and instrumented.

    python -m lit_ddp.fit --devices 4

In a script of your own (docs/callbacks.md)::

    from lit_ddp import PhaseTimer, CommMonitor, SyncCheck, DeviceMap, LossMonitor, LitDDPStrategy, DDPTuner, load_run
    from lit_ddp import write_timeline  # a run's record as a timeline: docs/traces.md#the-timeline

Importing lit_ddp changes nothing in your process; ``lit_ddp.quiet_lightning()`` hides Lightning's start-up lines
and unactionable warnings, as ``python -m lit_ddp.fit`` does for itself.
"""

import time

# `python -m lit_ddp.fit` imports this package first: a run's wall time counts from here, imports included.
STARTED = time.perf_counter()

# The public names and the module each comes from, imported on first use: the commands that only read records
# (report, forecast, the probe) start without Lightning (seconds of its import). The callbacks come from their
# package, the tuner from its room.
_PUBLIC = {
    "PhaseTimer": "lit_ddp.callbacks",
    "CommMonitor": "lit_ddp.callbacks",
    "SyncCheck": "lit_ddp.callbacks",
    "DeviceMap": "lit_ddp.callbacks",
    "LossMonitor": "lit_ddp.callbacks",
    "DDPTuner": "lit_ddp.tuner",
    "LitDDPStrategy": "lit_ddp.run.strategy",
    "load_run": "lit_ddp.records.schema",
    "write_timeline": "lit_ddp.present.timeline",
    "quiet_lightning": "lit_ddp.run.console",
    "FixedBatchDataModule": "lit_ddp.lab.data",
    "LinearRegression": "lit_ddp.lab.module",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'lit_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
