"""Who never arrived, when a collective times out: named on every rank that did arrive.

    python -m lit_ddp.fit --devices 2 --trainer.strategy.timeout_s 10    # a rank that hangs: the others say which

A collective that times out says only that this rank waited; the ranks that never came say nothing (they are
hung). So every rank that times out writes "I was here" into the job's rendezvous store (it is not the process
group that just failed), waits a few seconds for the others to do the same, and names the ranks that did not
in its error, with the step and, when CommMonitor is on, the bucket whose all-reduce it waited for. Nothing of
this runs before a timeout. A rank cut off from the store (it lives on rank 0's node) cannot ask it: the store's
client has no timeout of its own there, so its calls are bounded here, and that rank names rank 0's node as lost.
"""

import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from lit_ddp import _torch

WAIT_S = 5.0  # for the other ranks that arrived to time out too and say so
ANSWER_S = 2.0  # for the store's first answer: without one, this rank is cut off from it


def is_timeout(exception: BaseException) -> bool:
    text = str(exception).lower()
    return "timed out" in text or "timeout" in text


def absent_ranks(store: dist.Store, rank: int, world_size: int, tag: str, wait_s: float = WAIT_S,
                 answered: Optional[threading.Event] = None) -> list[int]:  # fmt: skip
    """Marks ``rank`` present under ``tag`` and returns the ranks not marked within ``wait_s`` seconds; sets
    ``answered`` once the store has answered."""
    store.set(f"{tag}/{rank}", "1")
    deadline = time.monotonic() + wait_s
    while True:
        absent = [r for r in range(world_size) if not store.check([f"{tag}/{r}"])]
        if answered is not None:
            answered.set()
        if not absent or time.monotonic() > deadline:
            return absent
        time.sleep(0.1)


def absent_ranks_unless_cut_off(store: dist.Store, rank: int, world_size: int, tag: str) -> Optional[list[int]]:
    """``absent_ranks``, or None when the store gives no answer within ``ANSWER_S`` (or none in the end).

    ``TCPStore.check`` and ``set`` wait for the store's reply without a timeout (``set_timeout`` bounds ``get`` and
    ``wait`` only), and a store behind a cut link never replies: TCP retransmits for some 15 minutes. So the calls
    run in a daemon thread, which is left behind, blocked, when they do not return; the process can still exit."""
    answered = threading.Event()
    result: list = []

    def run() -> None:
        try:
            result.append(absent_ranks(store, rank, world_size, tag, WAIT_S, answered))
        except Exception as err:  # handed to the caller
            result.append(err)
        finally:
            answered.set()

    thread = threading.Thread(target=run, name="lit_ddp-store", daemon=True)
    thread.start()
    if not answered.wait(ANSWER_S):
        return None
    thread.join(WAIT_S + ANSWER_S)
    if not result:
        return None
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def _ranks(ranks: list[int], ranks_per_node: Optional[int]) -> str:
    """``rank(s) [1]``, and with several nodes ``rank(s) [1] (node 1)``."""
    if not ranks_per_node:
        return f"rank(s) {ranks}"
    nodes = sorted({r // ranks_per_node for r in ranks})
    return f"rank(s) {ranks} (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"


def name_absent_ranks(exception: BaseException, rank: int, world_size: int, step: int,
                      where: Optional[str] = None, ranks_per_node: Optional[int] = None) -> None:  # fmt: skip
    """On a timeout, puts the ranks that never arrived (at ``where``, in ``step``) at the front of the
    exception's message; once per exception, never raising itself, and never waiting more than
    ``WAIT_S + 2 * ANSWER_S``. ``ranks_per_node`` (several nodes only) adds each rank's node:
    ``rank // ranks_per_node``, as Lightning and torchrun number them."""
    if world_size < 2 or getattr(exception, "lit_ddp_named", False) or not is_timeout(exception):
        return
    store = _torch.default_store()
    if store is None:
        return
    exception.lit_ddp_named = True
    place = where or f"the collective of step {step}"
    try:
        store.set_timeout(timedelta(seconds=WAIT_S))  # rank 0 hosts the store: it may be the one that hangs
        absent = absent_ranks_unless_cut_off(store, rank, world_size, f"lit_ddp/arrived/{step}/{place}")
    except Exception:  # the store is gone too: nothing to add
        return
    if absent is None:
        # The store never answered: its host, rank 0's node, is out of this rank's reach (a partition, or it is
        # down). Every rank there is lost to this one; of the others nothing can be learned without the store.
        host_ranks = list(range(ranks_per_node or 1))
        if rank in host_ranks:
            return
        line = (f"{_ranks(host_ranks, ranks_per_node)} lost at {place}: the rendezvous store they host did not "
                f"answer for {ANSWER_S:g} s either (a network partition, or their node is down); "
                f"{_ranks([rank], ranks_per_node)} waited there until the timeout")  # fmt: skip
        exception.args = (f"{line}: {exception.args[0] if exception.args else ''}", *exception.args[1:])
        return
    if absent:
        present = [r for r in range(world_size) if r not in absent]
        line = (
            f"{_ranks(absent, ranks_per_node)} never arrived at {place}; {_ranks(present, ranks_per_node)} "
            "waited there until the timeout"
        )
        exception.args = (f"{line}: {exception.args[0] if exception.args else ''}", *exception.args[1:])
