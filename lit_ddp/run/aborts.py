"""A thread's SIGABRT held for the watchdog, so that a collective whose sizes differ between ranks gets named.

    python -m benchmarks.hang_zoo --cases epoch_end_log_rank0_ckpt     # Lightning#19604 with checkpointing on

gloo's transport thread aborts its process on a message larger than its buffer (``gloo::EnforceNotMet``, uncaught:
``std::terminate``), and rank 0's abort takes the store with it. ``install`` (the watchdog's start, main thread)
puts a handler in place that holds an aborting thread other than the main one, while ``on_abort`` says yes (the
fit live, 2 ranks or more), for at most ``hold_s`` (the watchdog's ``ABORT_HOLD_S``): the store answers, the ranks
are compared and the watchdog's ``os._exit`` ends the job with the divergence's line. Past ``hold_s`` the abort
goes on as it would have (the previous handler, e.g. faulthandler's, then the default). torch's own aborts in
other threads (NCCL's watchdog taking the process down at its timeout) are held alike, at most ``hold_s`` while the
hang is named, then the same abort. Never held: the main thread's, a second one, a forked child's, one at exit.
Linux only; nothing runs before a SIGABRT. docs/failures.md#the-watchdog-a-hang-named-as-it-happens.
"""

import atexit
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Optional


class _Sigaction(ctypes.Structure):
    """glibc's ``struct sigaction`` (x86-64 and aarch64): saved and put back whole, flags included."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]  # fmt: skip


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_callback: Optional[ctypes._CFuncPtr] = None  # ours, kept alive while installed
_previous = _Sigaction()  # the action that was there before ours
_on_abort: Optional[Callable[[], bool]] = None
_hold_s = 0.0
_pid = 0
_held = threading.Event()  # a thread is (or was) held: a second abort goes on at once
_release = threading.Event()  # set at exit: the held thread aborts now


def install(on_abort: Callable[[], bool], hold_s: float) -> bool:
    """On the main thread, once per process: ``on_abort()`` is called in the aborting thread and says whether to
    hold it, for at most ``hold_s``. False where it cannot be installed (not Linux, not the main thread)."""
    global _callback, _on_abort, _hold_s, _pid
    _on_abort, _hold_s = on_abort, hold_s
    if _callback is not None:
        return True
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return False
    callback = _HANDLER(_handle)
    ours = _Sigaction(handler=ctypes.cast(callback, ctypes.c_void_p).value)  # SIGABRT blocked while it runs
    if _libc().sigaction(signal.SIGABRT, ctypes.byref(ours), ctypes.byref(_previous)) != 0:
        return False
    _callback, _pid = callback, os.getpid()
    _held.clear()
    _release.clear()
    atexit.register(_at_exit)
    os.register_at_fork(after_in_child=uninstall)
    return True


def uninstall() -> None:
    """The action that was there before ``install``, back (unless another has replaced ours since)."""
    global _callback
    if _callback is None:
        return
    now = _Sigaction()
    libc = _libc()
    libc.sigaction(signal.SIGABRT, None, ctypes.byref(now))
    if now.handler == ctypes.cast(_callback, ctypes.c_void_p).value:
        libc.sigaction(signal.SIGABRT, ctypes.byref(_previous), None)
    _callback = None


def _at_exit() -> None:
    if _held.is_set() and _callback is not None:  # a thread held while the script ends: its abort, now
        _release.set()
        threading.Event().wait(_hold_s)  # the GIL let go: the held thread raises its SIGABRT, which ends this
    uninstall()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _abort_as_before() -> None:
    """The previous action back and SIGABRT raised again: blocked while this handler runs, it is delivered to that
    action as the handler returns (and glibc's ``abort`` ends the process whatever that action does)."""
    libc = _libc()
    libc.sigaction(signal.SIGABRT, ctypes.byref(_previous), None)
    libc["raise"](signal.SIGABRT)


def _handle(signum: int) -> None:
    """In the aborting thread, with the GIL (taken by ctypes for the callback)."""
    try:
        main = threading.main_thread().ident == threading.get_ident()
        if not main and not _held.is_set() and os.getpid() == _pid:
            _held.set()
            if _on_abort is not None and _on_abort():
                _release.wait(_hold_s)  # the watchdog's os._exit ends the process before, from its own thread
    except BaseException:  # noqa: BLE001 - nothing may escape a C callback: the abort goes on
        pass
    _abort_as_before()
