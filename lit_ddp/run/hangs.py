"""Who never arrived, when a collective times out: named on every rank that did arrive.

    python -m lit_ddp.fit --devices 2 --trainer.strategy.timeout_s 10    # a rank that hangs: the others say which

A collective that times out says only that this rank waited; the ranks that never came say nothing (they are
hung). So every rank that times out writes "I was here" into the job's rendezvous store (it is not the process
group that just failed), waits a few seconds for the others to do the same, and names the ranks that did not
in its error, with the step and, when CommMonitor is on, the bucket whose all-reduce it waited for. Nothing of
this runs before a timeout.
"""

import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from lit_ddp import _torch

WAIT_S = 5.0  # for the other ranks that arrived to time out too and say so


def is_timeout(exception: BaseException) -> bool:
    text = str(exception).lower()
    return "timed out" in text or "timeout" in text


def absent_ranks(store: dist.Store, rank: int, world_size: int, tag: str, wait_s: float = WAIT_S) -> list[int]:
    """Marks ``rank`` present under ``tag`` and returns the ranks not marked within ``wait_s`` seconds."""
    store.set(f"{tag}/{rank}", "1")
    deadline = time.monotonic() + wait_s
    while True:
        absent = [r for r in range(world_size) if not store.check([f"{tag}/{r}"])]
        if not absent or time.monotonic() > deadline:
            return absent
        time.sleep(0.1)


def name_absent_ranks(exception: BaseException, rank: int, world_size: int, step: int,
                      where: Optional[str] = None) -> None:  # fmt: skip
    """On a timeout, puts the ranks that never arrived (at ``where``, in ``step``) at the front of the
    exception's message; once per exception, and never raising itself."""
    if world_size < 2 or getattr(exception, "lit_ddp_named", False) or not is_timeout(exception):
        return
    store = _torch.default_store()
    if store is None:
        return
    exception.lit_ddp_named = True
    place = where or f"the collective of step {step}"
    try:
        store.set_timeout(timedelta(seconds=WAIT_S))  # rank 0 hosts the store: it may be the one that hangs
        absent = absent_ranks(store, rank, world_size, f"lit_ddp/arrived/{step}/{place}")
    except Exception:  # the store is gone too: nothing to add
        return
    if absent:
        present = [r for r in range(world_size) if r not in absent]
        line = f"rank(s) {absent} never arrived at {place}; rank(s) {present} waited there until the timeout"
        exception.args = (f"{line}: {exception.args[0] if exception.args else ''}", *exception.args[1:])
