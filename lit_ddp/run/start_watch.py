"""The watch of a rank's start in a script of one's own: armed when a tool callback is made, it follows the rank
through torch's rendezvous (who joined, 5 s into the wait and every 10 s after; one line naming who never did at the
start's timeout, and the job ended) and hands the rank to its watchdog the moment the process group exists, before
``prepare_data``.

    python -m benchmarks.hang_zoo --cases rank1_never_joins,prepare_data_barrier   # named, ended, nothing left

One daemon thread a process looks at the main thread twice a second: once that waits in torch's
``init_process_group`` (its arguments: rank, world size, timeout; the environment: the address; Lightning's strategy
further out: the nodes and the ranks this process launched), the thread meets the others' in rank 0's store as
``python -m lit_ddp.fit`` does (``lit_ddp.run.rendezvous.meet``), beside torch's own rendezvous. One whose caller
meets its ranks itself (LitDDPStrategy, through ``lit_ddp.run.rendezvous``) is left to it. The thread ends when it
hands over, when the fit's ``setup`` starts the watchdog (``disarm``), or with the process: never during training.
docs/failures.md#the-watchdog-a-hang-named-as-it-happens.
"""

import contextlib
import inspect
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lit_ddp import _lightning
from lit_ddp.errors import EXIT_FAILED, StartTimeoutError, prog
from lit_ddp.run import rendezvous, watchdog
from lit_ddp.run.rendezvous import meet

POLL_S = 0.5  # how often the thread looks at the main thread (a walk of its stack: 41 µs at 60 frames, here)
# The line comes this long before torch's own error at the same timeout (torch's clock starts when its
# rendezvous does, the thread's up to POLL_S later).
MARGIN_S = 1.5
# srun waits for every task by default: the ones that never joined would sleep on after this one's exit 1.
SRUN_WAITS = "srun ends the other tasks at this exit only with --kill-on-bad-exit=1 (slurm/*.sbatch set it)"
_INIT = inspect.unwrap(dist.init_process_group).__code__ if dist.is_available() else None


class Start(NamedTuple):
    """A rank in torch's rendezvous, as its ``init_process_group`` call and Lightning's strategy show it."""

    rank: int
    world_size: int
    address: str
    port: int
    timeout_s: float
    ranks_per_node: int
    started: dict[str, Any]  # how it was started, for the line that names who never joined
    launched: list[int]  # the pids of the ranks this process started (Lightning's ``ddp`` launcher)
    caller_meets: bool  # the caller meets its ranks itself (LitDDPStrategy, through lit_ddp.run.rendezvous)


def rendezvous_of(frame: Any) -> Optional[Start]:
    """The rendezvous the stack of ``frame`` waits in (innermost first), or None: not in ``init_process_group``."""
    call, strategy, caller_meets = None, None, False
    while frame is not None:
        if call is None and frame.f_code is _INIT:
            call = dict(frame.f_locals)
        # Its ``store`` local says nothing: torch sets it once its own rendezvous is over (the backend's may wait on).
        caller_meets |= frame.f_globals.get("__name__") == rendezvous.__name__
        me = frame.f_locals.get("self")
        if call is not None and isinstance(me, DDPStrategy):
            strategy = me
            break
        frame = frame.f_back
    if call is None:
        return None
    env = os.environ
    rank = call.get("rank", -1) if call.get("rank", -1) >= 0 else int(env.get("RANK", "0"))
    world_size = call.get("world_size", -1) if call.get("world_size", -1) > 0 else int(env.get("WORLD_SIZE", "1"))
    timeout = call.get("timeout") or dist.default_pg_timeout
    caller_meets |= call.get("init_method") not in (None, "env://")
    per_node = strategy.num_processes if strategy is not None else int(env.get("LOCAL_WORLD_SIZE", world_size))
    started = {"host": socket.gethostname(), "world_size": world_size}
    if strategy is not None:
        started.update(num_nodes=strategy.num_nodes, devices=strategy.num_processes)
    launched = _lightning.launched_pids(strategy) if strategy is not None else []
    return Start(rank, world_size, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "0")),
                 timeout.total_seconds(), max(per_node, 1), started, launched, caller_meets)  # fmt: skip


class StartWatch:
    """One per process (``arm``): a daemon thread that watches the main thread's rendezvous, then hands over."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._stopped = threading.Event()
        self._watched = False
        self._thread = threading.Thread(target=self._run, name="lit_ddp-start-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S)

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            if dist.is_available() and dist.is_initialized():
                return self._hand_over()
            start = rendezvous_of(sys._current_frames().get(threading.main_thread().ident))
            if start is not None and start.world_size > 1 and not start.caller_meets and not self._watched:
                self._watched = True
                self._watch(start)

    def _over(self) -> bool:
        return self._stopped.is_set() or dist.is_initialized()

    def _watch(self, start: Start) -> None:
        """Meets the other ranks' watches in rank 0's store until the process group exists; at the deadline, ends
        the job with the line that names who never joined."""
        deadline = time.monotonic() + start.timeout_s - MARGIN_S
        where = f"{start.address}:{start.port}"
        speaks = start.rank != 0 and start.rank % start.ranks_per_node == 0  # rank 0 dials its own store
        try:
            if not rendezvous.reach(start.address, start.port, start.rank, start.ranks_per_node,
                                    deadline - time.monotonic(), start.started, speaks, done=self._over):  # fmt: skip
                return
            store = dist.TCPStore(start.address, start.port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))  # fmt: skip
        except StartTimeoutError as err:  # nothing answered at the address within the start's time
            if not self._over() and start.rank != 0:
                self._end(start, str(err))
            return
        except Exception:  # the store's host went as it answered: torch's own error ends this rank
            return
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None:  # torchrun's store outlives a restart: each attempt meets afresh, as torch's own does
            store = dist.PrefixStore(f"lit_ddp/attempt_{attempt}", store)
        try:
            meet(store, start.rank, start.world_size, deadline - time.monotonic(), start.started,
                 start.ranks_per_node, where, done=self._over)  # fmt: skip
        except StartTimeoutError as err:
            if not self._over():
                self._end(start, str(err))
        except Exception:  # the store's host went: the job ended elsewhere, and torch's own error ends this rank
            return

    def _end(self, start: Start, line: str) -> None:
        """The start failed: the first rank of each node says why, and every process of the job goes (the ranks
        this one launched first: one asleep before its ``fit`` would never notice)."""
        if "SLURM_STEP_ID" in os.environ and not start.launched:  # srun started every rank, this one alone exits
            line += f"; {SRUN_WAITS}"
        if start.rank % start.ranks_per_node == 0:
            print(f"{prog()}: {line}", file=sys.stderr, flush=True)
        for pid in start.launched:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sys.stdout.flush()
        os._exit(EXIT_FAILED)

    def _hand_over(self) -> None:
        """The process group exists: from now on the rank's watchdog watches (before ``prepare_data``)."""
        global _OVER
        _OVER = self.pid
        with contextlib.suppress(Exception):  # the group went meanwhile (a test's, destroyed)
            watchdog.start(dist.get_rank(), dist.get_world_size())


_ARMED: Optional[StartWatch] = None
_OVER: Optional[int] = None  # the process whose start is over (handed over, or the fit's setup came)


def arm() -> None:
    """From a tool callback's construction: this process's start watch, once (a fork's child, into which the
    object came without its thread, arms its own)."""
    global _ARMED
    if _OVER == os.getpid() or (_ARMED is not None and _ARMED.pid == os.getpid()):
        return
    _ARMED = StartWatch()
    _ARMED.start()


def disarm() -> None:
    """The fit's ``setup`` (``CollectiveRecorder``): the watchdog takes over from here, and the thread ends."""
    global _ARMED, _OVER
    _OVER = os.getpid()
    if _ARMED is not None and _ARMED.pid == os.getpid():
        _ARMED.stop()
    _ARMED = None
