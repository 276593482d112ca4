"""A run's life around ``trainer.fit``: who launched a rank, dying with the launcher, naming a dead rank,
SIGTERM in a parent that only launches, tearing the process group down, and turning how the run ended into
the exit code and the one line a user reads (the codes: ``lit_ddp.errors``). SIGTERM in a training process
travels with the step's collective: ``lit_ddp.callbacks.step_sync``.

    python -m lit_ddp.fit --devices 2      # then: kill -TERM <pid>  -> every rank stops at one step, exit 143
"""

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from lit_ddp import _lightning, _torch
from lit_ddp.analysis.stopped import FIX_DEAD
from lit_ddp.errors import AGREED_ERRORS, EXIT_FAILED, EXIT_USAGE, PROG, Ending, UsageError
from lit_ddp.run import exits, launched, watchdog

# At exit, how long a rank waits in the store for the others to come there too, before it destroys its process
# group all the same: longer than the watchdog takes to end a job whose rank waits in a collective nobody else
# calls (a few seconds), so that its line comes first.
EXIT_WAIT_S = 30.0
EXIT_KEY = exits.EXIT_KEY
LEFT_KEY = "lit_ddp/exit/left"  # the ranks but 0 that made their last call on the store
LEAVE_WAIT_S = 5.0  # rank 0 waits at most this for them (they are past the meeting: milliseconds)
TRACEBACK_LINES = 12  # of a failed rank's traceback, shown before the line that names the rank
# The launcher's pid, in the environment of the ranks it starts (see launcher_pid_for_children).
LAUNCHER_PID_ENV = "LIT_DDP_LAUNCHER_PID"


@contextmanager
def launcher_pid_for_children() -> Iterator[None]:
    """Around the start of the ranks a Lightning launcher starts itself (``lit_ddp.run.launchers``): they inherit
    this process's pid in ``LIT_DDP_LAUNCHER_PID``, and die with it (``follow_launcher``). This process's own
    environment is as before once they have started (a ``ddp`` launcher) or ended (``ddp_fork``/``ddp_spawn``)."""
    previous = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = previous


def follow_launcher(environment: ClusterEnvironment) -> None:
    """A rank that Lightning started dies with its launcher.

    Lightning's child observer (``ddp``) runs in rank 0 and watches the children only, and torch's spawn
    (``ddp_spawn``) watches from the parent: if that process dies, the ranks it started would wait in a
    collective until the timeout, or train on, or hang on forever. A stale value inherited by a torchrun or
    Slurm rank is ignored: those have their own environments.
    """
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    if launcher_pid is None or int(launcher_pid) == os.getpid() or type(environment) is not LightningEnvironment:
        return
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != int(launcher_pid):  # the launcher died before the call above
            os._exit(1)


def stop_launched_ranks(strategy, first_rank: int, wait_s: float = 1.0) -> None:
    """On a failure in rank 0 of the ``ddp`` launcher: name the launched ranks that exited with an error, then
    kill the rest (``lit_ddp.run.launched``: once, whichever of the strategy and the callbacks comes first). Lightning
    kills them only on KeyboardInterrupt, so a hung rank would outlive rank 0, whose own error is often just
    "connection reset by peer". Waits up to ``wait_s`` for a dead rank to be reaped."""
    procs = _lightning.launched_ranks(strategy)
    if procs:
        launched.stop(procs, first_rank, wait_s)


@contextmanager
def launcher_forwards_sigterm(strategy) -> Iterator[list[int]]:
    """Around ``fit`` in a process that only launches ranks and waits (``ddp_fork``/``ddp_spawn``): SIGTERM is
    passed on to the ranks, which stop together at a step boundary and save ``last.ckpt``; yields the list of
    signals forwarded (empty: none), by which the caller knows the run ended by SIGTERM. Elsewhere (the ``ddp``
    launcher's rank 0, torchrun) the process trains itself and ``StepSync`` handles SIGTERM."""
    received: list[int] = []
    if not _lightning.trains_in_children(strategy):
        yield received
        return

    def forward(signum, frame) -> None:
        received.append(signum)
        for pid in _lightning.launched_pids(strategy):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = signal.signal(signal.SIGTERM, forward)
    sys.stdout.flush()  # a fork copies unflushed buffers into every rank
    sys.stderr.flush()
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def teardown_process_group(wait_s: float = EXIT_WAIT_S) -> None:
    """Lightning leaves the process group alive, and gloo's threads then die in interpreter teardown
    ("terminate called without an active exception", SIGABRT, seen under torchrun). Every rank should be past its
    last collective: the group is destroyed while everything is still alive (pytorch#75097), once every rank has
    come here or ``wait_s`` has passed. They meet in the rendezvous store, not in a collective: a barrier waits the
    whole timeout on a peer that failed or waits in a collective of its own (a rank-0-only ``trainer.log_dir``
    after fit). Such a peer is named by its watchdog, which this rank's leaving tells (``Watchdog.leave``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world_size = dist.get_world_size()
    watch = watchdog.current()
    if watch is not None:
        watch.leave()
    store = _torch.default_store()
    if store is not None and world_size > 1:
        with contextlib.suppress(Exception):  # the store's host has gone: nobody left to wait for
            store.add(EXIT_KEY, 1)
            host = dist.get_rank() == 0  # the store's host: its leaving takes the store from the others
            if host:
                wait_s = max(wait_s, _torch.default_group_timeout_s() or 0.0)
            exits.wait_for_the_others(store, world_size, wait_s, host)
            everyone, ended = store.add(EXIT_KEY, 0) >= world_size, store.check([watchdog.ENDED_KEY])
            if ended:  # a peer's watchdog ends the job: leave it the last word
                time.sleep(watchdog.ENDING_S + 1.0)
            if watch is not None:
                watch.stop(wait_s=1.0)  # its thread's last call on the store made, before the store's host goes
            if everyone and not ended:
                _leave_the_host_last(store, dist.get_rank(), world_size)
    if watch is not None:
        watch.stop()
    dist.destroy_process_group()


def _leave_the_host_last(store: Any, rank: int, world_size: int) -> None:
    """Rank 0 (the store's host under Lightning's launcher and env://) leaves once every other rank has made its last
    call on the store: a call that finds the host gone makes torch print a warning with a C++ stack on that rank."""
    if rank != 0:
        store.add(LEFT_KEY, 1)
        return
    deadline = time.monotonic() + LEAVE_WAIT_S
    while store.add(LEFT_KEY, 0) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.02)


def teardown_at_exit() -> None:
    """An ``atexit`` handler (``exit_cleanly`` registers it): the process group a script's Trainer left alive, torn
    down as ``teardown_process_group`` does before the interpreter finalizes. Left to finalization, a gloo worker
    thread that drops the last reference to a finished work's tensors takes the GIL while the interpreter is being
    torn down, and the thread's forced exit aborts the process ("terminate called without an active exception",
    exit -6; pytorch#190489). Lightning does this at exit for NCCL only. Nothing after an uncaught exception: the
    other ranks may never reach the barrier (their own error ends them)."""
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return
    teardown_process_group()


def exit_cleanly() -> None:
    """This process tears its process group down at exit (``teardown_at_exit``); registered once, however often it
    is called. For a process whose training ended normally only (``lit_ddp.callbacks.shared.ExitsCleanly``): after
    a failure a rank may be hung in a collective, and the barrier would wait for it until the timeout."""
    atexit.unregister(teardown_at_exit)
    atexit.register(teardown_at_exit)


def exit_code(run: Callable[[], Ending], prog: str = PROG) -> int:
    """Runs ``run`` and turns how it ended into the exit code and the one line a user reads (``prog: ...``)."""
    agreed = {kind.__name__: code for kind, code in AGREED_ERRORS.items()}
    try:
        ending = run()
    except tuple(AGREED_ERRORS) as err:
        if rank_zero_only.rank == 0 or getattr(err, "speaks", False):
            print(f"{prog}: {type(err).__name__}: {err}", file=sys.stderr)
        return AGREED_ERRORS[type(err)]
    except UsageError as err:
        # Every task that srun or torchrun started parses the same command line: one of them says what is wrong
        # (before any Trainer exists, Lightning takes the rank from SLURM_PROCID / RANK).
        if rank_zero_only.rank == 0:
            print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except SIGTERMException:
        # Lightning's own SIGTERM path (a Trainer without StepSync): a SystemExit with no code, i.e. exit 0.
        ending = Ending.SIGTERM
    except ProcessRaisedException as err:  # a rank that ddp_fork/ddp_spawn started raised; err.msg: its traceback
        lines = err.msg.strip().splitlines()
        kind, _, message = lines[-1].partition(": ")
        name = kind.rpartition(".")[2]
        if name in agreed:
            print(f"{prog}: {name}: {message}", file=sys.stderr)
            return agreed[name]
        # The innermost frames say where; the whole traceback of a spawned rank runs to some 80 lines of
        # Lightning's loops.
        print("\n".join(lines[-TRACEBACK_LINES:]), file=sys.stderr)
        print(f"{prog}: rank {err.error_index} exited with code 1: {name}: {message}", file=sys.stderr)
        return EXIT_FAILED
    except ProcessExitedException as err:  # ... or died
        how = f"signal {err.signal_name}" if err.signal_name else f"code {err.exit_code}"
        why = getattr(err, "lit_ddp_diagnosis", None)  # what NCCL's Flight Recorder dumps show (run/launchers)
        # Its own cause is in its log, or (a signal and none) the kernel's: what the dumps show, else where to look
        print(f"{prog}: rank {err.error_index} exited with {how}" + (f": {why}" if why else f" -> {FIX_DEAD}"),
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILED
    if ending is Ending.SIGTERM and rank_zero_only.rank == 0:
        print(f"{prog}: stopped by SIGTERM", file=sys.stderr)
    return int(ending)
