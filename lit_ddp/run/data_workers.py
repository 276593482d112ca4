"""The DataLoader worker a rank waits on, and that worker's line: for the watchdog's state of a stopped rank.

    python -m benchmarks.hang_zoo --cases worker_stuck     # rank 1's worker stuck in __getitem__: its line named

A worker forked from a rank inherits faulthandler's handler for ``WORKER_SIGNAL``: sent that signal, it writes its
own stack into the rank's file, whatever it is stuck in; and it dies with its rank (Linux: PR_SET_PDEATHSIG).
"""

import ctypes
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Optional

from lit_ddp import _torch
from lit_ddp.analysis.flight_recorder import Frame, user_frame
from lit_ddp.run import frozen

WORKER_SIGNAL = signal.SIGUSR2  # a DataLoader worker writes its stack on it (faulthandler, inherited at fork)


class Workers:
    """One per watchdog: ``prepare`` once on the main thread (before any worker is forked), then ``waited_on``."""

    def __init__(self) -> None:
        self._file: Optional[Any] = None

    @property
    def prepared(self) -> bool:
        return self._file is not None

    @property
    def dump_file(self) -> Optional[Any]:
        """The file faulthandler writes into on ``WORKER_SIGNAL`` (this rank's own stack too: run/frozen.py)."""
        return self._file

    def prepare(self) -> None:
        if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
            return
        self._file = tempfile.TemporaryFile("w+")
        faulthandler.register(WORKER_SIGNAL, file=self._file, all_threads=False)
        os.register_at_fork(after_in_child=_die_with_parent)

    def waited_on(self, frame) -> str:
        """``DataLoader worker 0 (pid 123) at data.py:20 __getitem__: time.sleep(3600)``, where the main thread
        waits for a batch from a worker process; ``""`` otherwise."""
        while frame is not None:
            waits = _torch.loader_waits_for(frame.f_locals.get("self"))
            if waits is not None:
                worker_id, pid = waits
                return f"DataLoader worker {worker_id} (pid {pid}){self._line(pid)}"
            frame = frame.f_back
        return ""

    def _line(self, pid: int) -> str:
        if self._file is None or not frozen.catches(pid, WORKER_SIGNAL):
            return ""
        self._file.seek(0)
        self._file.truncate()
        os.kill(pid, WORKER_SIGNAL)
        time.sleep(0.2)
        self._file.seek(0)
        frames = [Frame(path, int(line), name) for path, line, name in _faulthandler_frames(self._file.read())]
        where = user_frame(frames[::-1])  # faulthandler lists the innermost first
        return f" at {where}" if where else ""


def _faulthandler_frames(text: str) -> list[tuple[str, str, str]]:
    """``  File "x.py", line 20 in __getitem__`` lines, as (path, line, name)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('File "') and " line " in line and " in " in line:
            path, _, rest = line[6:].partition('", line ')
            number, _, name = rest.partition(" in ")
            out.append((path, number.strip(), name.strip()))
    return out


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
