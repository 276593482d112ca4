"""Callbacks that make DDP visible, in any LightningModule's Trainer: loss printing, the device map, phase
timing, communication accounting, sync checks."""

from lit_ddp.callbacks.comm_monitor import CommMonitor
from lit_ddp.callbacks.device_map import DeviceMap
from lit_ddp.callbacks.loss_monitor import LossMonitor
from lit_ddp.callbacks.phase_timer import PhaseTimer
from lit_ddp.callbacks.run_summary import RunSummary
from lit_ddp.callbacks.step_sync import StepSync
from lit_ddp.callbacks.sync_check import SyncCheck
from lit_ddp.errors import NonFiniteLossError, SyncError
from lit_ddp.run import console

# In a script that uses these callbacks, as in the CLI: Lightning's start-up lines and warnings hidden
# (LIT_DDP_QUIET_LIGHTNING=0 keeps them; docs/callbacks.md).
console.quiet_lightning()


def __getattr__(name: str):
    """``DDPTuner`` lives in ``lit_ddp.tuner``, the floor above: the old import line keeps working, imported on
    first use (an upward import the floors' contract does not see), until ``from lit_ddp import DDPTuner`` is the
    public way (issue 33) and this goes."""
    if name == "DDPTuner":
        import importlib

        return importlib.import_module("lit_ddp.tuner").DDPTuner
    raise AttributeError(f"module 'lit_ddp.callbacks' has no attribute {name!r}")


__all__ = [
    "CommMonitor",
    "DDPTuner",
    "DeviceMap",
    "LossMonitor",
    "NonFiniteLossError",
    "PhaseTimer",
    "RunSummary",
    "StepSync",
    "SyncCheck",
    "SyncError",
]
