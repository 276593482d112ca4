"""lit_ddp.run.aborts: a native thread's SIGABRT is held for the watchdog (which ends the process its own way);
the main thread's, a refused one, a second one, a forked child's, one at exit and one past the hold end as they
would have (SIGABRT, through the handler that was there before). Real subprocesses, each its own process's handler.
"""

import signal
import subprocess
import sys
import textwrap

import pytest

from lit_ddp.run import watchdog
from lit_ddp.run.watchdog import COMPARE_AFTER_S, Watchdog

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a C-level SIGABRT handler: Linux only")

# A thread as gloo's transport thread is: native, never seen by Python, calling abort() (std::terminate does).
PRELUDE = textwrap.dedent(
    """
    import ctypes, faulthandler, os, sys, threading, time
    from lit_ddp.run import aborts
    libc = ctypes.CDLL(None)
    asked = threading.Event()

    def native_abort():
        tid = ctypes.c_ulong()
        assert libc.pthread_create(ctypes.byref(tid), None, ctypes.cast(libc.abort, ctypes.c_void_p), None) == 0

    def on_abort():
        print("asked", flush=True)
        asked.set()
        return HOLD
    """
)
SCRIPTS = {
    # held: the watchdog's os._exit(1) ends the process while the aborting thread waits
    "held": "HOLD = True; aborts.install(on_abort, 600); native_abort(); asked.wait(30); os._exit(3)",
    "refused": "HOLD = False; aborts.install(on_abort, 600); native_abort(); time.sleep(30)",
    "main thread": "HOLD = True; aborts.install(on_abort, 600); libc.abort()",
    "second": "HOLD = True; aborts.install(on_abort, 600); native_abort(); asked.wait(30); native_abort(); "
    "time.sleep(30)",
    # the script ends while a thread is held: its abort goes on at exit
    "at exit": "HOLD = True; aborts.install(on_abort, 600); native_abort(); asked.wait(30)",
    # a DataLoader worker's abort is its own: the child aborts at once, and the parent's hook is not asked
    "forked child": "HOLD = True; aborts.install(on_abort, 600)\n"
    "pid = os.fork()\n"
    "if pid == 0:\n    native_abort(); time.sleep(30); os._exit(0)\n"
    "print('child', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True); os._exit(0)",
    # past the hold: the previous handler (faulthandler's, as under pytest) runs, then the default abort
    "past the hold": "HOLD = True; faulthandler.enable(); aborts.install(on_abort, 1.0); native_abort(); "
    "time.sleep(30)",
}
ENDS = {  # exit code, whether the hook was asked
    "held": (3, True),
    "refused": (-signal.SIGABRT, True),
    "main thread": (-signal.SIGABRT, False),
    "second": (-signal.SIGABRT, True),
    "at exit": (-signal.SIGABRT, True),
    "forked child": (0, False),
    "past the hold": (-signal.SIGABRT, True),
}


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_only_a_live_thread_s_first_abort_is_held_and_every_other_ends_as_before(case: str) -> None:
    """A wrongly held abort would wait its 600 s: the run's timeout fails the test."""
    done = subprocess.run([sys.executable, "-c", PRELUDE + SCRIPTS[case]], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    code, asked = ENDS[case]
    assert done.returncode == code, done.stderr
    assert ("asked" in done.stdout) == asked, done.stdout
    if case == "forked child":
        assert f"child {-signal.SIGABRT}" in done.stdout
    if case == "past the hold":
        assert "Fatal Python error: Aborted" in done.stderr  # faulthandler's, which was there before


def test_the_watchdog_holds_an_abort_only_while_live_and_compares_at_once():
    dog = Watchdog(0, 2)
    dog._times.extend([0.0, 1.0])  # its last step began at 1.0
    assert dog.due(1.5) == ""
    assert dog._on_abort() and dog.aborting
    assert dog.due(1.5) == "publish"  # not COMPARE_AFTER_S later: a held rank will not move again
    assert dog.state(0.5)["aborting"] is True
    for not_live in ({"fit_over": True}, {"left": True}, {"world_size": 1}, {"pid": -1}):
        other = Watchdog(0, 2)
        for name, value in not_live.items():
            setattr(other, name, value)
        assert not other._on_abort() and not other.aborting, not_live
    stopped = Watchdog(0, 2)
    stopped.stop()
    assert not stopped._on_abort()
    assert watchdog.ABORT_HOLD_S > COMPARE_AFTER_S + watchdog.SPEAKER_WAIT_S


def test_a_collective_of_a_lightning_callback_is_named_by_the_callback():
    """Lightning#19604's other rank waits in ModelCheckpoint's reduce_boolean_decision, under the user's
    ``trainer.fit`` line: the divergence names the callback's method; from the user's own frame, nothing."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    frames = []
    strategy = SimpleNamespace(reduce_boolean_decision=lambda decision, all: frames.append(sys._getframe(1)))
    ModelCheckpoint().file_exists("x.ckpt", SimpleNamespace(is_global_zero=False, strategy=strategy))
    assert watchdog._callback_of(frames[0]) == "ModelCheckpoint.file_exists"
    assert watchdog._callback_of(sys._getframe()) == ""
