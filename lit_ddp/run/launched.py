"""The ranks that rank 0 of Lightning's ``ddp`` launcher started (ranks 1..N-1 of its node): stopped with it, once.

    python -m benchmarks.hang_zoo --cases rank1_holds_the_gil    # rank 1 frozen in a C call: none left running

Lightning kills them only on KeyboardInterrupt (``lightning.pytorch.trainer.call._call_and_handle_interrupt``). When
rank 0 fails (an exception through ``on_exception``: ``lifecycle.stop_launched_ranks``) or ends the job itself (the
watchdog's ``_exit``), a rank frozen in a call that holds the GIL would run on: neither its SIGTERM handler nor its own
watchdog can run. Each rank gets a short chance to exit by itself, then SIGKILL.
"""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple, Optional

from lit_ddp import _lightning
from lit_ddp.analysis.stopped import FIX_DEAD
from lit_ddp.errors import prog

_STOPPED: set[int] = set()  # pids this process stopped: once each, whoever asks again


class Launched(NamedTuple):
    procs: list[subprocess.Popen]
    first_rank: int


_LAUNCHED: Optional[Launched] = None


def remember(procs: Optional[list[subprocess.Popen]], first_rank: int) -> None:
    """At setup in the launching rank (``CollectiveRecorder.setup``): the ranks it started, for ``stop_all``."""
    global _LAUNCHED
    _LAUNCHED = Launched(procs, first_rank) if procs else None
    if procs:  # Lightning's observer SIGKILLs the ranks and this process when one fails: their children first
        _lightning.before_the_observer_kills(lambda: kill_below(os.getpid()))


def stop(procs: list[subprocess.Popen], first_rank: int, wait_s: float = 1.0, name_dead: bool = True) -> None:
    """Names the ranks that exited with an error (``name_dead``), then kills the rest; ``wait_s``: how long a rank
    has to exit (or a dead one to be reaped) first. A rank stopped before is left alone: its line said once."""
    procs = [p for p in procs if p.pid not in _STOPPED]
    if not procs:
        return
    _STOPPED.update(p.pid for p in procs)
    ranks = {p.pid: first_rank + i for i, p in enumerate(procs)}
    deadline = time.monotonic() + wait_s
    while True:
        codes = {p.pid: p.poll() for p in procs}
        failed = [pid for pid, code in codes.items() if code not in (None, 0)]
        if failed or None not in codes.values() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if name_dead:
        for pid in failed:
            print(f"{prog()}: rank {ranks[pid]} exited with code {codes[pid]} -> {FIX_DEAD}", file=sys.stderr)
    below = [pid for proc in procs if proc.poll() is None for pid in descendants(proc.pid)]  # before they lose them
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    _kill(below)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # reaped: gone from the process table before this rank exits


def stop_all(wait_s: float = 1.0) -> None:
    """The ranks ``remember`` holds, stopped (``stop``) without naming any: the caller's line was the last word."""
    if _LAUNCHED is not None:
        stop(_LAUNCHED.procs, _LAUNCHED.first_rank, wait_s, name_dead=False)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, its children's children too (/proc/<pid>/task/<tid>/children, Linux): a rank's
    DataLoader workers die with it (PR_SET_PDEATHSIG at their fork), but a process it started through ``subprocess``
    (an upload, a tool; ``_posixsubprocess`` runs no at-fork hook) would outlive it."""
    found, todo = [], [pid]
    while todo:
        for children in glob.glob(f"/proc/{todo.pop()}/task/*/children"):
            with contextlib.suppress(OSError, ValueError):
                with open(children) as file:
                    kids = [int(kid) for kid in file.read().split()]
                found += kids
                todo += kids
    return found


def kill_below(pid: int) -> None:
    """SIGKILL to every process below ``pid`` (``descendants``): before ``pid`` itself exits, or is killed."""
    _kill(descendants(pid))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
