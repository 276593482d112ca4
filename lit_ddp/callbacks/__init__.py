"""Callbacks that make DDP visible: loss printing, phase timing, communication accounting, sync checks."""

from lit_ddp.callbacks.loss_monitor import LossMonitor, NonFiniteLossError

__all__ = ["LossMonitor", "NonFiniteLossError"]
