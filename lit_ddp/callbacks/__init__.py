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

# Nothing else happens on import: a ddp_spawn rank of a script that called `lit_ddp.quiet_lightning()` imports this
# package to unpickle the callbacks, and quiets itself here as that script asked (its environment says so).
console.quiet_if_asked()


__all__ = [
    "CommMonitor",
    "DeviceMap",
    "LossMonitor",
    "NonFiniteLossError",
    "PhaseTimer",
    "RunSummary",
    "StepSync",
    "SyncCheck",
    "SyncError",
]
