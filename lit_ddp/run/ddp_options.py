"""DDP's options by the names the installed torch takes, and torch's PowerSGD hook: for LitDDPStrategy and the
tuner's trials alike, so that a trial runs what the strategy of a tuned config will run.

    python -m lit_ddp.fit --trainer.strategy.init_args.powersgd_rank 1 --devices 2
"""

import inspect
from collections.abc import Callable

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel


def powersgd(rank: int, start_step: int) -> tuple[powerSGD_hook.PowerSGDState, Callable]:
    """torch's PowerSGD (error feedback, warm start) at matrix ``rank`` on the default process group, compressing
    from step ``start_step`` (>= 2; plain all-reduces before): the state and hook for ``register_comm_hook``."""
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=start_step)  # fmt: skip
    return state, powerSGD_hook.powerSGD_hook


def buffer_sync(on: bool) -> dict[str, bool]:
    """DDP's kwargs for syncing buffers at each forward: torch's default when ``on``; off, by the name the installed
    torch takes (``forward_sync_buffers`` since 2.13, where ``broadcast_buffers`` warns that it is deprecated)."""
    if on:
        return {}
    takes = inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers": False}
