"""The start watch of a script of one's own (``lit_ddp.run.start_watch``): what it reads from a rank waiting in torch's
rendezvous, and its thread's life (armed by a tool callback, gone when the fit's setup comes). The real runs, a rank
that never joins and a collective in prepare_data, are the zoo's (tests/test_hang_zoo.py)."""

import os
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lit_ddp.callbacks import LossMonitor
from lit_ddp.lab.data import FixedBatchDataModule
from lit_ddp.lab.module import LinearRegression
from lit_ddp.run import rendezvous, start_watch
from tests.runner import free_port


def _waits_in(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _stack_once_waiting(thread: threading.Thread, deadline_s: float = 10.0):
    """``rendezvous_of`` the thread's stack, once it shows a rendezvous (or None at the deadline)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = start_watch.rendezvous_of(sys._current_frames().get(thread.ident))
        if found is not None:
            return found
        time.sleep(0.05)
    return None


def _env_rendezvous(port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:  # rank 1 never comes: torch's own store gives up at the timeout
        dist.init_process_group("gloo", rank=0, world_size=2, timeout=timedelta(seconds=4))
    except Exception:
        pass


def _lit_ddp_rendezvous(port: int) -> None:
    try:  # its meeting passed (patched out): torch's backend waits for rank 1 until the timeout
        rendezvous.init_process_group("gloo", 0, 2, "127.0.0.1", port, timedelta(seconds=4), torch.device("cpu"),
                                      timedelta(seconds=4), {}, 2)  # fmt: skip
    except Exception:
        pass


@pytest.mark.timeout(60)
def test_a_rank_in_torchs_rendezvous_is_read_from_its_stack_and_one_lit_ddp_holds_is_left_to_it(monkeypatch):
    port = free_port()
    waiting = _waits_in(_env_rendezvous, port)
    found = _stack_once_waiting(waiting)
    assert found is not None
    assert (found.rank, found.world_size, found.address, found.port, found.timeout_s) == (0, 2, "127.0.0.1", port, 4)
    assert not found.caller_meets and found.launched == [] and found.started["world_size"] == 2
    monkeypatch.setattr(rendezvous, "meet", lambda *args, **kwargs: None)
    waiting_too = _waits_in(_lit_ddp_rendezvous, free_port())
    held = _stack_once_waiting(waiting_too)
    assert held is not None and held.caller_meets  # LitDDPStrategy's: it meets its ranks itself
    assert start_watch.rendezvous_of(sys._current_frames()[threading.get_ident()]) is None  # not in one
    for thread in (waiting, waiting_too):  # torch gives up at the timeout: nothing of theirs left for the next test
        thread.join(timeout=30)


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lit_ddp-start-watch" and t.is_alive()]


@pytest.mark.timeout(120)
def test_a_tool_callback_arms_the_watch_once_and_a_fit_leaves_no_thread_of_it(make_trainer, monkeypatch):
    start_watch.disarm()  # an earlier test's watch (this process launched forked ranks: it never disarmed)
    monkeypatch.setattr(start_watch, "_OVER", None)  # this process as if it had made no Trainer yet
    callbacks = [LossMonitor(), LossMonitor()]
    assert len(_watch_threads()) == 1  # one a process, however many callbacks
    make_trainer(devices=1, spawn=False, callbacks=callbacks).fit(LinearRegression(), FixedBatchDataModule())
    assert _watch_threads() == []
    LossMonitor()  # the start is over in this process: no new watch
    assert _watch_threads() == []


class _Exited(Exception):
    pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("step_id, launched, says", [("0", [], True), (None, [], False), ("0", [2**22 + 7], False)],
                         ids=["srun-task", "no-slurm", "launched-its-ranks"])  # fmt: skip
def test_the_line_of_an_srun_task_says_that_srun_waits_for_the_others_unless_told(monkeypatch, capsys, step_id,
                                                                                   launched, says):  # fmt: skip
    """Under srun every rank is a task of Slurm's: rank 0's exit at the start's timeout ends the rank that never
    joined only with ``--kill-on-bad-exit=1``; a process that launched its ranks ends them itself."""
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    if step_id is not None:
        monkeypatch.setenv("SLURM_STEP_ID", step_id)
    monkeypatch.setattr(start_watch.os, "_exit", lambda code: (_ for _ in ()).throw(_Exited(code)))
    monkeypatch.setattr(start_watch.os, "kill", lambda pid, sig: None)
    start = start_watch.Start(0, 2, "vm", 15003, 20.0, 2, {}, launched, False)
    with pytest.raises(_Exited):
        start_watch.StartWatch()._end(start, "rank 1 (node 0) never joined")
    line = capsys.readouterr().err.strip()
    assert line.startswith("lit_ddp: rank 1 (node 0) never joined")
    assert line.endswith(f"; {start_watch.SRUN_WAITS}") == says, line


@pytest.mark.timeout(30)
def test_a_watch_whose_rank_0_store_never_answers_ends_the_job_with_the_line_that_names_node_0(monkeypatch):
    """A script's rank 1, alone on node 1: nothing listens at rank 0's address (node 0 never started). Its watch dials
    (``rendezvous.reach``) until the start's timeout less ``MARGIN_S`` and ends the job with the line naming node 0,
    before torch's own client, which dials past its timeout in silence."""
    port = free_port()  # nothing listens there
    start = start_watch.Start(1, 2, "127.0.0.1", port, start_watch.MARGIN_S + 2.0, 1, {"host": "b"}, [], False)
    watch, ended = start_watch.StartWatch(), []
    monkeypatch.setattr(watch, "_end", lambda start, line: ended.append(line))
    watch._watch(start)
    assert len(ended) == 1 and ended[0].startswith(
        f"rank 0 (node 0) never joined: its store at 127.0.0.1:{port} did not answer rank 1 (node 1, host b) in 2 s "
        "(Connection refused) -> a node that never started, or out of reach"
    ), ended
