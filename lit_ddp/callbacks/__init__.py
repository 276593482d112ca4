"""Callbacks that make DDP visible, in any LightningModule's Trainer: loss printing, the device map, phase
timing, communication accounting, sync checks."""

import atexit

from lit_ddp.callbacks.comm_monitor import CommMonitor
from lit_ddp.callbacks.device_map import DeviceMap
from lit_ddp.callbacks.loss_monitor import LossMonitor
from lit_ddp.callbacks.phase_timer import PhaseTimer
from lit_ddp.callbacks.run_summary import RunSummary
from lit_ddp.callbacks.step_sync import StepSync
from lit_ddp.callbacks.sync_check import SyncCheck
from lit_ddp.errors import NonFiniteLossError, SyncError
from lit_ddp.run import console, lifecycle

# In a script that uses these callbacks, as in the CLI (docs/callbacks.md): Lightning's start-up lines and
# warnings hidden (LIT_DDP_QUIET_LIGHTNING=0 keeps them), and the process group torn down before the interpreter
# exits, so that no rank aborts at exit.
console.quiet_lightning()
atexit.register(lifecycle.teardown_at_exit)

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
