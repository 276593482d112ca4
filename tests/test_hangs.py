"""A collective that times out names the ranks that never arrived, on every rank that did."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lit_ddp import _torch
from lit_ddp.run import hangs


def test_every_rank_that_arrived_names_the_ones_that_did_not(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(_torch, "default_store", lambda: store)
    monkeypatch.setattr(hangs, "WAIT_S", 1.0)
    errors = {rank: RuntimeError("Timed out waiting 10000ms for recv operation to complete") for rank in (0, 2)}
    where = "the all-reduce of bucket 1 in step 7"
    threads = [threading.Thread(target=hangs.name_absent_ranks, args=(errors[r], r, 3, 7, where)) for r in errors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    for rank, error in errors.items():
        assert str(error) == ("rank(s) [1] never arrived at the all-reduce of bucket 1 in step 7; rank(s) [0, 2] "
                              "waited there until the timeout: Timed out waiting 10000ms for recv operation to "
                              "complete"), rank  # fmt: skip


@pytest.mark.parametrize("message", ["out of memory", "loss is nan"])
def test_other_errors_are_left_as_they_are(monkeypatch, message):
    monkeypatch.setattr(_torch, "default_store", lambda: pytest.fail("no store for a non-timeout"))
    error = RuntimeError(message)
    hangs.name_absent_ranks(error, 0, 2, 3)
    assert str(error) == message


def test_when_everyone_arrived_nothing_is_added(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(_torch, "default_store", lambda: store)
    store.set("lit_ddp/arrived/3/the collective of step 3/1", "1")
    error = RuntimeError("Timed out")
    hangs.name_absent_ranks(error, 0, 2, 3)
    assert str(error) == "Timed out"


def test_with_several_nodes_each_rank_is_named_with_its_node(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(_torch, "default_store", lambda: store)
    monkeypatch.setattr(hangs, "WAIT_S", 0.5)
    error = RuntimeError("Timed out")
    hangs.name_absent_ranks(error, 0, 4, 9, ranks_per_node=2)  # ranks 1..3 never mark themselves
    assert str(error) == ("rank(s) [1, 2, 3] (nodes 0, 1) never arrived at the collective of step 9; rank(s) [0] "
                          "(node 0) waited there until the timeout: Timed out")  # fmt: skip


class SilentStore:
    """A store behind a cut link: every call waits for a reply that never comes (TCPStore's ``check`` and ``set``
    have no timeout of their own)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def set_timeout(self, timeout) -> None:
        pass

    def set(self, key, value) -> None:
        self.released.wait()

    def check(self, keys) -> bool:
        self.released.wait()
        return True


def test_a_rank_cut_off_from_the_store_names_the_node_that_hosts_it_and_returns(monkeypatch):
    """Node 1 of 2 (2 ranks each) behind a cut link: its rank 3 names rank 0's node, whose store did not answer,
    instead of waiting on the store for ever (the call is left blocked in a daemon thread)."""
    store = SilentStore()
    monkeypatch.setattr(_torch, "default_store", lambda: store)
    monkeypatch.setattr(hangs, "ANSWER_S", 0.2)
    error = RuntimeError("Timed out waiting 10000ms for recv operation to complete")
    try:
        naming = threading.Thread(target=hangs.name_absent_ranks, args=(error, 3, 4, 12, None, 2), daemon=True)
        naming.start()
        naming.join(timeout=30)
        assert not naming.is_alive(), "name_absent_ranks waited on a store that never answers"
    finally:
        store.released.set()
    assert str(error) == ("rank(s) [0, 1] (node 0) lost at the collective of step 12: the rendezvous store they "
                          "host did not answer for 0.2 s either (a network partition, or their node is down); "
                          "rank(s) [3] (node 1) waited there until the timeout: Timed out waiting 10000ms for recv "
                          "operation to complete")  # fmt: skip


def test_rank_0_that_hangs_while_its_store_still_answers_is_named(monkeypatch):
    """Rank 0 hosts the store: its server thread answers while its training thread hangs, so ranks 1 and 2 of 3
    reach the store and must name rank 0, not take it for present (nor for cut off: the store answered)."""
    from tests.runner import free_port

    port, timeout = free_port(), timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", port, 3, True, timeout=timeout, wait_for_workers=False)  # noqa: F841
    clients = {f"rank{r}": dist.TCPStore("127.0.0.1", port, 3, False, timeout=timeout) for r in (1, 2)}
    monkeypatch.setattr(_torch, "default_store", lambda: clients[threading.current_thread().name])
    monkeypatch.setattr(hangs, "WAIT_S", 1.0)
    errors = {rank: RuntimeError("Timed out waiting 10000ms for recv operation to complete") for rank in (1, 2)}
    threads = [threading.Thread(target=hangs.name_absent_ranks, args=(errors[r], r, 3, 4), name=f"rank{r}")
               for r in errors]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    for rank, error in errors.items():
        assert str(error) == (
            "rank(s) [0] never arrived at the collective of step 4; rank(s) [1, 2] waited there "
            "until the timeout: Timed out waiting 10000ms for recv operation to complete"
        ), rank
