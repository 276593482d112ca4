"""A collective that times out names the ranks that never arrived, on every rank that did."""

import threading

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
