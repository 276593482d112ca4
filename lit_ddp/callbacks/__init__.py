"""Callbacks that make DDP visible: loss printing, phase timing, communication accounting, sync checks."""

from lit_ddp.callbacks.comm_monitor import CommMonitor
from lit_ddp.callbacks.loss_monitor import LossMonitor, NonFiniteLossError
from lit_ddp.callbacks.phase_timer import PhaseTimer
from lit_ddp.callbacks.sync_check import SyncCheck, SyncError

__all__ = ["CommMonitor", "LossMonitor", "NonFiniteLossError", "PhaseTimer", "SyncCheck", "SyncError"]
