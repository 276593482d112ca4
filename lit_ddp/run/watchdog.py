"""A watchdog thread in every rank: when the job stops moving, where each rank is, said while it happens.

    python tests/hang_scripts.py sleep --timeout-s 600     # rank 1 sleeps in its step: named in ~12 s, not 600

From lit_ddp's first code in a rank until it exits; one clock read a step (``beat``). Stopped ``COMPARE_AFTER_S``,
a rank puts its state (stack, user's line, the collective it waits in, the DataLoader worker it waits on) in the
rendezvous store, not the process group; what is certain (``certain``) ends the job at once. Past ``max(hang_after_s,
steps_k x the median step)`` the lowest rank prints where every rank is, again as the wait doubles; a wait is never
ended for its length. How and why: docs/failures.md#the-watchdog-a-hang-named-as-it-happens.

What a case reads (stderr, lines starting ``lit_ddp: ``): ``waiting N s: rank R has been at <line> for N s (step S,
<phase>), outside any collective; rank Q waits in <op> #<seq> ... -> <fix>``, ``moved on after N s``, and the
ending ``<the diverged line> -> <fix>`` (exit 1 on every rank, their DataLoader workers killed; a ddp_fork/ddp_spawn
parent ends with it in its ProcessExitedException).
"""

import atexit
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, Optional

from lightning.pytorch import Callback
from torch.distributed import DistNetworkError

from lit_ddp import _lightning, _torch
from lit_ddp.analysis import user_source
from lit_ddp.analysis.flight_recorder import LIBRARIES, Frame, user_frame
from lit_ddp.analysis.stopped import certain, in_collective, waiting_line
from lit_ddp.errors import EXIT_FAILED, prog
from lit_ddp.measure.clock import host_now
from lit_ddp.measure.collectives import CollectiveRecord
from lit_ddp.run import aborts, console, data_workers, frozen, hangs, launched

# At least this long without progress before a rank is said to wait: above a slow first step's usual share on 2
# loaded CPU cores (3-6 s for the notes' model, docs/failures.md) and short enough that the line comes within 15 s.
HANG_AFTER_S = 10.0
# ... and at least this many median steps: a step's tail on a shared machine stays within 3x its median
# (docs/stragglers.md), so 5x is no straggler, and a 30 s step waits 150 s before its line.
STEPS_K = 5.0
POLL_S = 0.5  # how often the thread looks at its rank's clock
# Stopped this long, a rank publishes its state and compares: a certain divergence is known without waiting for
# the line (well above a healthy step's wait in a collective on 2 CPU ranks: a few ms, docs/stragglers.md).
COMPARE_AFTER_S = 3.0
PUBLISH_EVERY_S = 2.0  # while stopped: the state (a Flight Recorder read, a stack) at most this often
GRACE_S = 2.0  # after publishing, for the other ranks' states (they stopped within a step of each other)
KEY = "lit_ddp/watch/"  # + rank: that rank's state, as JSON
ENDED_KEY = "lit_ddp/watch/ended"  # the line a rank ended the job with: the ranks at exit stop waiting
SEEN_KEY = "lit_ddp/watch/seen/"  # + rank: a stopped peer saw the ended key and exits (its main thread says nothing)
ENDING_S = 2 * POLL_S + 0.5  # from that key to the speaker's exit, at most: each stopped peer's next tick sees it
SPEAKER_WAIT_S = 3.0  # a rank that found the ending waits this long for the lowest rank to say it
# A thread's abort held this long at most (lit_ddp.run.aborts): the peers publish COMPARE_AFTER_S after their last
# progress, this rank's next tick compares, and the ranks end within SPEAKER_WAIT_S; twice that on a loaded machine.
ABORT_HOLD_S = 2 * (COMPARE_AFTER_S + 2 * POLL_S + SPEAKER_WAIT_S)
SAID_KEPT = 32  # lines kept for the record: they come as a wait doubles, so a run says few
STACK_FRAMES = 8  # of the main thread's stack, innermost last, in a rank's state


class Watchdog:
    """One per process (``start``); the thread is a daemon, and does nothing until its rank stops moving.

    Args:
        rank, world_size: this process's place in the job.
        hang_after_s: the least time without progress before the rank's state is published.
        steps_k: ... and at least this many median steps.
        clock: ``time.monotonic``; tests give a fake.
    """

    def __init__(self, rank: int, world_size: int, hang_after_s: float = HANG_AFTER_S, steps_k: float = STEPS_K,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not hang_after_s > 0 or not steps_k > 0:
            raise ValueError(f"`Watchdog(hang_after_s={hang_after_s!r}, steps_k={steps_k!r})` must be > 0")
        self.rank, self.world_size = rank, world_size
        self.hang_after_s, self.steps_k, self._clock = hang_after_s, steps_k, clock
        self.record: Optional[CollectiveRecord] = None  # the CollectiveRecorder's, for the step and phase
        self._step: Optional[int] = None
        self._times: deque[float] = deque(maxlen=64)  # step boundaries
        self.alive_at = clock()  # the last progress that is not a step boundary
        self.left = False  # this process is past its script (at exit)
        self.fit_over = False  # its fit's training ended: what the rank does next is the user's, even alone
        self.stopped: Optional[user_source.Stopped] = None  # its fit ended on ``trainer.should_stop``
        self.batches: dict[str, int] = {}  # each loop's batches on this rank where known, and how many it finished
        self.done: dict[str, int] = {}
        self.store: Optional[Any] = None  # the rendezvous store, once there is one
        self._since: Optional[float] = None  # the stop being reported: its last progress
        self._published_at = self._first_published_at = 0.0
        self._next_line = 0.0  # the wait's length at which the next line is due
        self._printed = False
        self.lines: list[str] = []  # what this rank printed (tests read it)
        # ... with the step and the host clock's time (the record's StepRow.start_s clock), for the fit's record
        self.said: deque[tuple[Optional[int], float, str]] = deque(maxlen=SAID_KEPT)
        self.ended: Optional[str] = None  # the line the job ended with
        self.aborting = False  # a thread of this rank aborts, held (lit_ddp.run.aborts): compare now
        self._thread: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        self.workers = data_workers.Workers()  # the DataLoader worker its main thread waits on
        self.pid = os.getpid()  # a forked child inherits this object, but not its thread: it makes its own

    # -- on the training thread: one clock read per step, nothing else --
    def beat(self, step: int) -> None:
        """A step boundary (called at several hooks of a step; the first of each step counts)."""
        if step != self._step:
            self._step = step
            self._times.append(self._clock())

    def alive(self) -> None:
        """Progress that is no step boundary: a validation batch, the start of training."""
        self.alive_at = self._clock()

    # -- the timing logic --
    def last_progress(self) -> float:
        return max(self._times[-1], self.alive_at) if self._times else self.alive_at

    def limit_s(self) -> float:
        """``max(hang_after_s, steps_k x the median step)``; the median of the steps this rank timed (the first
        left out: it holds the start's one-off work)."""
        steps = [b - a for a, b in itertools.pairwise(list(self._times)[1:])]
        return max(self.hang_after_s, self.steps_k * statistics.median(steps)) if steps else self.hang_after_s

    def due(self, now: float) -> str:
        """What the thread does at ``now``: ``""`` (nothing), ``"moved"`` (a published stop ended), ``"publish"``
        (stopped ``COMPARE_AFTER_S``: publish and compare, at most every ``PUBLISH_EVERY_S``), ``"line"``
        (stopped past ``limit_s``: publish, compare and print the waiting line; then each time the wait doubled)."""
        last = self.last_progress()
        stopped = max(now - last, COMPARE_AFTER_S if self.aborting else 0.0)  # an abort: it will not move again
        if stopped < COMPARE_AFTER_S or (self._since is not None and self._since != last):
            return "moved" if self._since is not None else ""
        if self._since is None:  # a new stop
            self._since, self._published_at, self._next_line, self._printed = last, -PUBLISH_EVERY_S, 0.0, False
            self._first_published_at = now
        if stopped >= max(self.limit_s(), self._next_line) and now - self._first_published_at >= GRACE_S:
            self._next_line = 2 * stopped  # growing intervals: 10, 20, 40, 80 s ...
            self._published_at = now
            return "line"
        if now - self._published_at >= PUBLISH_EVERY_S:
            self._published_at = now
            return "publish"
        return ""

    # -- the thread --
    def start(self) -> None:
        if not self.workers.prepared:  # on the main thread only: a watchdog the start watch began gets it at setup
            self._prepare()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lit_ddp-watchdog", daemon=True)
            self._thread.start()

    def _prepare(self) -> None:
        """On the main thread, before any DataLoader worker is forked."""
        self.workers.prepare()
        aborts.install(self._on_abort, ABORT_HOLD_S)

    def _on_abort(self) -> bool:
        """In a thread that aborts (``lit_ddp.run.aborts``): whether to hold it for this watchdog's comparison; no
        where the rank is past its fit or its script, alone, stopped, or another process's."""
        if self.left or self.fit_over or self._stopped.is_set() or self.world_size < 2 or os.getpid() != self.pid:
            return False
        self.aborting = True
        return True

    def stop(self, wait_s: float = 0.0) -> None:
        """The thread ends at its next poll (at teardown, before the process group and its store go); ``wait_s``:
        waits that long for it to have ended (its call on the store, if one is under way, done)."""
        self._stopped.set()
        if wait_s and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                self.tick(self._clock())
            except DistNetworkError:  # the store's host is gone: the job ended elsewhere
                if self._since is not None and not (self.left or self.fit_over or self._stopped.is_set()):
                    return self.orphaned(self._clock() - self._since)  # stopped in training: nothing else ends it
                return
            except Exception:  # the interpreter is exiting
                if self.store is not None and self._since is not None:
                    return

    def orphaned(self, stopped_s: float) -> None:
        """This rank is stopped outside the job's end (a sleep, a stuck DataLoader worker) and the job ended
        elsewhere: nothing else would end it. Says so and exits, its workers first (pytorch#41517)."""
        where = self.state(stopped_s)["report"].get("where") or "a line of Lightning or torch"
        self._say(f"rank {self.rank}: the job ended elsewhere (its store's host is gone) while this rank was at "
                  f"{where} for {stopped_s:.0f} s: exiting")  # fmt: skip
        hangs.FAILING.set()
        _exit()

    def tick(self, now: float) -> None:
        if hangs.FAILING.is_set():  # its own failure is being reported (a collective's timeout: the ranks' reports
            return  # compared, its stack in the store's thread's join), and that says what happened; its last state
        # from before stays in the store for the others
        if self.store is None:
            self.store = _torch.default_store()
            if self.store is None:
                return
        action = self.due(now) if not self.left else ""  # a rank that left published once, in leave()
        if action == "moved":
            stopped = now - self._since if self._since is not None else 0.0
            self._since = None
            self.store.delete_key(f"{KEY}{self.rank}")
            if self._printed:
                self._say(f"moved on after {stopped:.0f} s")
            return
        if not action and self._since is None and not self.left:
            return
        if action:
            self.publish(now - (self._since if self._since is not None else now))
        states = self.states()  # every tick while stopped: a peer's new state is compared as soon as it is there
        ending = certain(states)
        if ending is not None:
            return self.end(ending, speak=min(states) == self.rank, peers=set(states) - {self.rank})
        if action == "line" and min(states) == self.rank:
            self._printed = True
            self._say(waiting_line(states, self.world_size, frozen.read_silent(self.store, states, self.world_size)))

    def publish(self, stopped_s: float) -> None:
        self.store.set(f"{KEY}{self.rank}", json.dumps(self.state(stopped_s)))

    def leave(self) -> None:
        """At exit: this rank is past its script; said at once, so that a peer waiting in a collective it will
        never call learns it."""
        if self._printed and self._since is not None and self.last_progress() != self._since:
            self._say(f"moved on after {self.last_progress() - self._since:.0f} s")  # before the next tick came
        self._since = None
        self.left = True
        self.store = self.store or _torch.default_store()
        if self.store is not None and self.world_size > 1:
            with contextlib.suppress(Exception):  # the store's host has gone
                self.publish(0.0)

    def states(self) -> dict[int, dict[str, Any]]:
        keys = {r: f"{KEY}{r}" for r in range(self.world_size)}
        return {r: json.loads(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}

    def state(self, stopped_s: float) -> dict[str, Any]:
        """This rank's state, now: the main thread's stack, its user's line, the collective it waits in."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()
        frames = [Frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in stack]
        where = user_frame(frames)
        record = self.record or CollectiveRecord()
        kind = "left" if self.left else "collective" if in_collective(frames) else "busy"
        if kind == "busy" and _lightning.waits_at_prepare_data_barrier(frame):
            kind = "barrier"  # Lightning's own, on a group of its own: no collective of the job's until it opens
        # A sync_dist key that Lightning reduces after its hook returned (an epoch's value, from its loop): the
        # stack's user line is the fit's; the hook's line that logged the key is the one to name.
        reduced = _lightning.reduced_on(frame) if kind == "collective" else None
        if reduced is not None and f" {reduced.hook}: " not in f" {where}":
            where = user_source.logged_at(reduced.owners, reduced.hook, reduced.key)
        report = record.report(self.rank, kind, "", where)
        if kind == "collective" and report.collectives and report.collectives[-1].bucket is None:
            called = _callback_of(frame) if reduced is None else ""  # where the user's line is trainer.fit, or none
            at = f"{called} under {where}" if called and where else called or where  # the live stack: it waits there
            report.collectives[-1].where = at or report.collectives[-1].where
        return {
            "aborting": self.aborting,
            "rank": self.rank,
            "stopped_s": stopped_s,
            "report": report.as_json(),
            "worker": self.workers.waited_on(frame),
            "logged": reduced.key if reduced is not None else "",
            "logged_in": reduced.hook if reduced is not None else "",
            "batches": self.batches,
            "done": self.done,
            "waits_on": frozen.waits_on(threading.main_thread().native_id) if kind == "busy" else "",
            "stopped": self.stopped.text() if self.stopped is not None else "",
            "stack": [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-STACK_FRAMES:]],
        }

    def _say(self, text: str) -> None:
        line = f"{prog()}: {text}"
        self.lines.append(line)
        self.said.append((self._step, host_now(), text))
        print(line, file=sys.stderr, flush=True)

    def end(self, line: str, speak: bool = True, peers: Collection[int] = ()) -> None:
        """Ends this rank at once with ``line`` (a certain divergence): said (``speak``: the lowest rank that
        published; the others wait until it has, or say it themselves after ``SPEAKER_WAIT_S``), left for a
        launching parent, the rank's own child processes (its DataLoader workers) ended first. The speaker leaves
        once the ``peers`` that published have seen the line (``ENDING_S`` at most), so that the line is the last."""
        self.ended = line
        hangs.FAILING.set()  # a SIGTERM from here on finds a rank that is ending, not hung
        # The main thread's collective fails as the peers leave, and it may reach the interpreter's end first, where
        # a live gloo group aborts (exit 134, pytorch#190489): there, the exit is this one (registered last, run first)
        atexit.register(_exit)
        if not speak:
            deadline = time.monotonic() + SPEAKER_WAIT_S
            with contextlib.suppress(Exception):  # the speaker's store is gone: it has said it and ended
                while not self.store.check([ENDED_KEY]) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if self.store.check([ENDED_KEY]):
                    self.store.set(f"{SEEN_KEY}{self.rank}", "1")
                    return _exit()
        self._say(line)
        console.silence()  # the last word: its main thread's collective fails as the peers leave, and says nothing
        launcher = os.environ.get("LIT_DDP_LAUNCHER_PID")
        if launcher and int(launcher) != os.getpid():  # before the key: a peer that sees it exits, and the parent
            with open(ended_file(int(launcher)), "w") as file:  # reads this file as soon as a rank has exited
                file.write(line)
        with contextlib.suppress(Exception):  # the ranks at exit stop waiting for this one before its store goes
            self.store.set(ENDED_KEY, line)
            deadline = time.monotonic() + ENDING_S
            while peers and not self.store.check([f"{SEEN_KEY}{r}" for r in peers]) and time.monotonic() < deadline:
                time.sleep(0.05)
        _exit()


def _callback_of(frame) -> str:
    """``ModelCheckpoint.file_exists``: the innermost method of a callback of Lightning's (or lit_ddp's) that the
    thread's stack is in, inside the user's innermost frame; ``""`` for none (a hook of the user's names it better)."""
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(LIBRARIES):
        if isinstance(owner := frame.f_locals.get("self"), Callback):
            return f"{type(owner).__name__}.{frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def _exit() -> None:
    launched.stop_all()  # rank 0 of Lightning's ddp launcher: the ranks it started, frozen ones too
    launched.kill_below(os.getpid())  # its DataLoader workers (stuck themselves, maybe), any process it started
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILED)


def ended_file(launcher_pid: int) -> str:
    """Where a rank that ended the job leaves its line for the launcher that started it."""
    return os.path.join(tempfile.gettempdir(), f"lit_ddp-ended-{launcher_pid}")


_WATCHDOG: Optional[Watchdog] = None
_CARRIED_OVER: list[Watchdog] = []  # watchdogs a fork copied in (a forked rank leaves by os._exit)


def start(rank: int, world_size: int) -> Watchdog:
    """This process's watchdog, started on the first call of a fit (later calls return it, ``world_size``
    updated). One inherited through a fork is not used: its thread did not come along, its store is the parent's,
    and the parent's thread may have held that store's lock at the fork (a rank's teardown then waited on the lock
    for ever). Nor is one whose fit has ended (it has left): its store went with that fit's process group."""
    global _WATCHDOG
    if _WATCHDOG is not None and (_WATCHDOG.pid != os.getpid() or _WATCHDOG.left):
        if _WATCHDOG.pid == os.getpid():
            _WATCHDOG.stop()
        else:  # kept, never freed here: freeing its store joins the parent's store thread, absent here (for ever)
            _CARRIED_OVER.append(_WATCHDOG)
        _WATCHDOG = None
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(rank, world_size)
    _WATCHDOG.rank, _WATCHDOG.world_size = rank, world_size
    if world_size > 1:
        _WATCHDOG.start()
        hangs.leave_at_once_on_an_error()
    return _WATCHDOG


def current() -> Optional[Watchdog]:
    """This process's own watchdog (not one a fork carried over), or None."""
    return _WATCHDOG if _WATCHDOG is not None and _WATCHDOG.pid == os.getpid() else None


def beat(step: int) -> None:
    """``Watchdog.beat`` of this process's watchdog, if it has one."""
    if _WATCHDOG is not None:
        _WATCHDOG.beat(step)


def fit_ended(stopped: Optional[user_source.Stopped] = None) -> None:
    """Training ended (``CollectiveRecorder.on_train_end``): a rank's own work after it, alone (a file it writes, an
    evaluation), is never ended for its peers having left. ``stopped``: it ended on ``trainer.should_stop``."""
    if _WATCHDOG is not None:
        _WATCHDOG.fit_over = True
        _WATCHDOG.stopped = stopped


def count_batches(loop: str, batches: float) -> None:
    """A ``loop``'s ("training", "validation", "test", "predict") batches on this rank as it begins (an iterable
    dataset's, inf, is unknown): a divergence at its end is uneven data, each rank's count said (``stopped``)."""
    if _WATCHDOG is not None and batches != float("inf"):
        _WATCHDOG.batches[loop], _WATCHDOG.done[loop] = int(batches), 0


def batch_done(loop: str) -> None:  # one of its batches ended: one dict update
    if _WATCHDOG is not None:
        _WATCHDOG.done[loop] = _WATCHDOG.done.get(loop, 0) + 1


def alive() -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.alive()
