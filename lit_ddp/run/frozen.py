"""A rank whose Python cannot run, read by a peer on its host: the watchdog's waiting line and the timeout's line
name it with its line, where they said "sent no state".

    python -m benchmarks.hang_zoo --cases rank1_holds_the_gil    # rank 1 in sum(range(10**11)): named in ~12 s

A rank's watchdog thread needs the GIL to publish its state: a main thread in one long C call that holds it (a C
extension's loop, ``sum(range(10**11))``) leaves the rank as silent as a dead one. So each rank puts its host, pid
and faulthandler's file in the store once, at setup (``publish``: the watchdog's file for its DataLoader workers,
reached through /proc). A rank on the same host that finds it silent (``read``) looks at /proc/<pid>: gone or a
zombie, it died; state T, it is stopped (SIGSTOP, Ctrl-Z, a debugger); else it sends the workers' signal, on which
faulthandler's C handler, which needs no GIL, writes the main thread's stack into that file. A rank alone on its host
is read by nobody: its peers, elsewhere, still say it sent no state. A rank's own main thread outside any collective
that waits in ``futex()`` with no timeout waits on a lock of its process (``waits_on_lock``, ``stopped.FIX_LOCK``).
"""

import json
import os
import platform
import re
import signal
import socket
import time
from typing import Any, NamedTuple, Optional

from lit_ddp.analysis.flight_recorder import Frame, user_frame
from lit_ddp.analysis.stopped import FIX_DEAD

KEY = "lit_ddp/frozen/"  # + rank: {"host", "pid", "file"}, set once at setup
STATE_KEY = "lit_ddp/watch/"  # + rank: the watchdog's state (its KEY): there, the rank's Python runs
DUMP_SIGNAL = signal.SIGUSR2  # data_workers.WORKER_SIGNAL: faulthandler writes the stack of the thread it lands on
DUMP_WAIT_S = 0.2  # the C handler writes at once; the wait is for the kernel to deliver the signal
FIX_GIL = ("one call that holds the GIL this long (a C extension's loop, a builtin over a huge input): bound it or "
           "split it; py-spy dump --native --pid shows its C frames")  # fmt: skip
FIX_D = "a read from a disk or a network file system that does not answer: check the mount (dmesg)"
FIX_STOPPED = "a stopped process: kill -CONT it, or let the debugger that holds it go on"
FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())  # the futex syscall's number, where known
WAIT4 = {"x86_64": 61, "aarch64": 260}.get(platform.machine())  # wait4's: a wait for a child process to exit
LOCK_READS = 3  # a thread seen in one futex() with no timeout this many times, LOCK_READ_S apart, waits on a lock
LOCK_READ_S = 0.02
_FRAME = re.compile(r'File "(.+)", line (\d+) in (\S+)')


class Seen(NamedTuple):
    """What a peer read of a silent rank: ``doing`` fits the waiting line after ``rank R``; ``fix`` ends it."""

    doing: str
    fix: str


def publish(store: Any, rank: int, dump_file: Any) -> None:
    """Once per fit, at setup: where a peer on this host finds this rank (``dump_file``: the file faulthandler
    writes into on ``DUMP_SIGNAL``, None off Linux)."""
    if store is None or dump_file is None:
        return
    me = {"host": socket.gethostname(), "pid": os.getpid(), "file": f"/proc/{os.getpid()}/fd/{dump_file.fileno()}"}
    store.set(f"{KEY}{rank}", json.dumps(me))


def read(store: Any, ranks: list[int], stopped_s: Optional[float] = None) -> dict[int, Seen]:
    """The ``ranks`` (silent ones) that run on this host, read from /proc and their faulthandler file; a rank on
    another host, or one that published nothing, is left out. ``stopped_s``: how long the peers have waited."""
    seen = {}
    for rank in ranks:
        key = f"{KEY}{rank}"
        try:
            them = json.loads(store.get(key)) if store is not None and store.check([key]) else None
            runs = them is not None and store.check([f"{STATE_KEY}{rank}"])  # its watchdog published: no GIL held
        except Exception:  # the store's host is gone: the caller learns it on its own next call
            return seen
        if them is None:
            continue
        if them["host"] == socket.gethostname() and them["pid"] != os.getpid():
            found = look(them["pid"], them["file"], stopped_s, stack=not runs)
            if found is not None:
                seen[rank] = found
    return seen


def look(pid: int, path: str, stopped_s: Optional[float] = None, stack: bool = True) -> Optional[Seen]:
    """What process ``pid`` does, from its /proc entry and (``stack``: its watchdog sent nothing, so its main thread
    holds the GIL) the main thread's stack that faulthandler writes into ``path``; None when nothing could be read."""
    state = _state(pid)
    if state in ("", "Z", "X"):
        return Seen(f"(pid {pid}) is gone: it died", FIX_DEAD)  # a zombie: dead, not yet reaped by its parent
    if state in ("T", "t"):
        return Seen(f"(pid {pid}) is stopped (state {state}: SIGSTOP, Ctrl-Z or a debugger)", FIX_STOPPED)
    if not stack or not catches(pid, DUMP_SIGNAL):  # a rank past its faulthandler (its exit) would die of it
        return None
    try:
        before = os.path.getsize(path)
        os.kill(pid, DUMP_SIGNAL)
        time.sleep(DUMP_WAIT_S)
        with open(path) as file:
            file.seek(before)
            text = file.read()
    except OSError:  # it exited meanwhile
        return None
    frames = [Frame(p, int(n), name) for p, n, name in _FRAME.findall(text)][::-1]  # faulthandler: innermost first
    if not frames:  # a signal waits while its process is in an uninterruptible wait in the kernel
        return (
            Seen(f"(pid {pid}) is in an uninterruptible wait in the kernel (state D)", FIX_D) if state == "D" else None
        )
    where = user_frame(frames) or f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}"
    for_s = f" for {stopped_s:.0f} s" if stopped_s is not None else ""
    return Seen(f"has been at {where}{for_s}, outside any collective, in a call that holds the GIL (its own watchdog "
                "cannot run)", FIX_GIL)  # fmt: skip


def waits_on_lock(tid: int) -> bool:
    """Whether this process's thread ``tid`` waits in the kernel on a lock with no timeout: Python's locks, and the
    events, queues, conditions and joins built on them, wait in ``futex()`` with a null timeout (the syscall's fourth
    argument in /proc/self/task/<tid>/syscall); ``time.sleep``, a socket's read, the GIL's timed wait and a wait with
    a timeout do not. False where /proc does not tell (not Linux, another architecture, no access)."""
    seen = set()
    for read in range(LOCK_READS):
        try:
            with open(f"/proc/self/task/{tid}/syscall") as file:
                words = file.read().split()
        except OSError:
            return False
        if FUTEX is None or len(words) < 5 or words[0] != str(FUTEX) or int(words[4], 16) != 0:
            return False
        seen.add(words[1])  # the futex's address: a busy consumer's fresh waits would show others
        if read < LOCK_READS - 1:
            time.sleep(LOCK_READ_S)
    return len(seen) == 1


def waits_on(tid: int) -> str:
    """What this process's thread ``tid`` waits on in the kernel with no end of its own: ``"lock"``
    (``waits_on_lock``), ``"child process 123 (sleep 3600)"`` where it waits in ``wait4()`` for a child to exit
    (``subprocess.run``, ``Popen.wait``, ``os.waitpid``), else ``""``."""
    if waits_on_lock(tid):
        return "lock"
    try:
        with open(f"/proc/self/task/{tid}/syscall") as file:
            words = file.read().split()
    except OSError:
        return ""
    if WAIT4 is None or len(words) < 2 or words[0] != str(WAIT4):
        return ""
    pid = int(words[1], 16)
    if not 0 < pid < 2**31:  # -1 (any child) and the like
        return "child process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"child process {pid}" + (f" ({command[:80]})" if command else "")


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` now (SigCgt of /proc/<pid>/status): faulthandler's is
    taken down as the interpreter finalizes, and the signal's default action then kills the process."""
    try:
        with open(f"/proc/{pid}/status") as file:
            caught = next(int(line.split()[1], 16) for line in file if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(caught >> (signum - 1) & 1)


def _state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat (R, S, D, T, t, Z ...); ``""``: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def read_silent(store: Any, states: dict[int, dict[str, Any]], world_size: int) -> dict[int, Seen]:
    """``read`` for the watchdog's waiting line: the ranks that put no state among ``states``."""
    silent = [r for r in range(world_size) if r not in states]
    stopped_s = max((s["stopped_s"] for s in states.values()), default=0.0)
    return read(store, silent, stopped_s) if silent else {}
