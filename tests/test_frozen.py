"""A rank whose Python cannot run, read by a peer on its host (``lit_ddp.run.frozen``): a real process in a call that
holds the GIL, stopped, dead; the lines that say it; and the zoo's case under Lightning's ``ddp`` launcher (slow),
named with its line and no process left behind (``lit_ddp.run.launched``)."""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from benchmarks.hang_zoo.run import load, run_case
from lit_ddp.analysis.divergence import RankReport, never_arrived
from lit_ddp.analysis.stopped import FIX_CHILD, FIX_DEAD, FIX_LOCK, waiting_line
from lit_ddp.run import frozen, launched, watchdog

HOLDS = """\
import faulthandler, os, signal, tempfile
dump = tempfile.TemporaryFile("w+")
faulthandler.register(signal.SIGUSR2, file=dump, all_threads=False)  # as the watchdog does for its workers


def crunch():
    print(f"/proc/{os.getpid()}/fd/{dump.fileno()}", flush=True)
    return sum(range(10**12))


crunch()
"""


@pytest.fixture
def holder(tmp_path):
    """A process in one long C call that holds the GIL, and its faulthandler file's path."""
    script = tmp_path / "holds.py"
    script.write_text(HOLDS)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    time.sleep(0.2)  # from its print into the sum: a few bytecodes
    yield proc, path
    proc.kill()
    proc.wait(timeout=10)


def wait_for_state(pid: int, state: str) -> None:
    while frozen._state(pid) != state:
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_a_process_in_a_call_that_holds_the_gil_is_read_at_its_line_then_stopped_then_dead(holder):
    proc, path = holder
    seen = frozen.look(proc.pid, path, stopped_s=12.0)
    assert seen == frozen.Seen("has been at holds.py:8 crunch: return sum(range(10**12)) for 12 s, outside any "
                               "collective, in a call that holds the GIL (its own watchdog cannot run)",
                               frozen.FIX_GIL)  # fmt: skip
    assert frozen.look(proc.pid, path, stack=False) is None  # its watchdog published: its Python runs
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for_state(proc.pid, "T")  # a signal's delivery is not at once
    assert frozen.look(proc.pid, path).doing == f"(pid {proc.pid}) is stopped (state T: SIGSTOP, Ctrl-Z or a debugger)"
    proc.kill()
    wait_for_state(proc.pid, "Z")  # a zombie until its parent reaps it, then nothing at all
    seen = frozen.look(proc.pid, path)
    assert seen == frozen.Seen(f"(pid {proc.pid}) is gone: it died", FIX_DEAD)
    proc.wait(timeout=10)
    assert frozen.look(proc.pid, path) == seen


@pytest.mark.timeout(30)
def test_a_process_without_faulthandlers_handler_is_not_sent_its_signal(holder, tmp_path):
    """A rank past its faulthandler (its interpreter finalizing after an error) would be killed by the signal, and
    its death read as a signal's (a new user's case: exit -12, "look for the out-of-memory killer")."""
    proc, _ = holder
    assert frozen.catches(proc.pid, frozen.DUMP_SIGNAL)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)  # into its sleep, past the interpreter's start
        assert not frozen.catches(plain.pid, frozen.DUMP_SIGNAL)
        (tmp_path / "dump").write_text("")
        assert frozen.look(plain.pid, str(tmp_path / "dump")) is None
        time.sleep(0.3)
        assert plain.poll() is None  # not killed by SIGUSR2's default action
    finally:
        plain.kill()
        plain.wait(timeout=10)
    assert not frozen.catches(plain.pid, frozen.DUMP_SIGNAL)  # gone: nothing to send to


@pytest.mark.timeout(30)
def test_a_peer_reads_the_silent_ranks_on_its_host_that_published(holder):
    proc, path = holder
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    store.set(f"{frozen.KEY}1", f'{{"host": "{os.uname().nodename}", "pid": {proc.pid}, "file": "{path}"}}')
    store.set(f"{frozen.KEY}2", f'{{"host": "elsewhere", "pid": {proc.pid}, "file": "{path}"}}')
    seen = frozen.read(store, [1, 2, 3], stopped_s=10.0)
    assert list(seen) == [1] and seen[1].doing.startswith("has been at holds.py:8 crunch: ")  # 2: other host; 3: none
    store.set(f"{frozen.STATE_KEY}1", "{}")  # its watchdog's state is there: a rank whose Python runs, not read
    assert frozen.read(store, [1]) == {}
    assert frozen.STATE_KEY == watchdog.KEY


def test_the_lines_say_what_was_read_instead_of_sent_nothing():
    grads = {
        "seq": 24,
        "op": "all_reduce",
        "sizes": [[9]],
        "dtype": "Float",
        "step": 3,
        "phase": "backward",
        "bucket": 0,
    }
    report = RankReport.from_json({"rank": 0, "failed_at": 0.0, "kind": "collective", "collectives": [grads]})
    state = {"rank": 0, "stopped_s": 12.0, "report": report.as_json(), "stack": []}
    seen = {1: ("has been at x.py:3 f: y() for 12 s, outside any collective, in a call that holds the GIL", "fix it")}
    assert waiting_line({0: state}, 2, seen) == (
        "waiting 12 s: rank 1 has been at x.py:3 f: y() for 12 s, outside any collective, in a call that holds the "
        "GIL; rank 0 waits in all_reduce #24 Float[9] (DDP gradient bucket 0) at step 3, backward -> fix it"
    )
    assert "sent no state" in waiting_line({0: state}, 3, seen)  # rank 2 not read: its words stay, and their fix
    assert never_arrived({0: report}, 2, "the collective of step 3", seen=seen) == (
        "rank(s) [1] never arrived at the collective of step 3; rank(s) [0] waited there until the timeout (in "
        "collective #24, all_reduce Float[9] (DDP gradient bucket 0) at step 3, backward; rank 1 has been at x.py:3 "
        "f: y() for 12 s, outside any collective, in a call that holds the GIL) -> fix it"
    )


@pytest.mark.skipif(frozen.FUTEX is None or not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/syscall"),
                    reason="reads /proc/self/task/<tid>/syscall on x86_64 or aarch64 Linux")  # fmt: skip
def test_a_thread_that_waits_on_a_lock_with_no_timeout_is_told_from_one_that_sleeps_or_may_wake():
    """Real threads of this process: a Lock's acquire, an Event's and a queue's wait with no timeout (futex with a
    null timeout) are lock waits; time.sleep and an Event's wait with a timeout are not."""
    import queue

    held, never, empty = threading.Lock(), threading.Event(), queue.Queue()
    held.acquire()
    waits = {
        "lock": held.acquire,
        "event": never.wait,
        "queue": empty.get,
        "sleep": lambda: time.sleep(3),
        "timed": lambda: never.wait(3),
    }
    threads = {name: threading.Thread(target=wait, daemon=True) for name, wait in waits.items()}
    for thread in threads.values():
        thread.start()
    time.sleep(0.3)
    seen = {name: frozen.waits_on_lock(thread.native_id) for name, thread in threads.items()}
    assert seen == {"lock": True, "event": True, "queue": True, "sleep": False, "timed": False}
    assert not frozen.waits_on_lock(threading.get_native_id())  # this thread runs: "running", not a syscall
    held.release(), never.set(), empty.put(None)


@pytest.mark.skipif(frozen.WAIT4 is None or not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/syscall"),
                    reason="reads /proc/self/task/<tid>/syscall on x86_64 or aarch64 Linux")  # fmt: skip
def test_a_thread_that_waits_for_a_child_process_is_told_with_the_childs_pid_and_command():
    """subprocess.run's wait (wait4) names the child; a lock stays "lock", a sleep nothing."""
    child = subprocess.Popen(["sleep", "30"])
    held = threading.Lock()
    held.acquire()
    waits = {"child": child.wait, "run": lambda: subprocess.run(["sleep", "30"]), "lock": held.acquire,
             "sleep": lambda: time.sleep(3)}  # fmt: skip
    threads = {name: threading.Thread(target=wait, daemon=True) for name, wait in waits.items()}
    for thread in threads.values():
        thread.start()
    time.sleep(0.3)
    seen = {name: frozen.waits_on(thread.native_id) for name, thread in threads.items()}
    ran = int(seen["run"].split()[2])  # subprocess.run's own child
    assert ran in launched.descendants(os.getpid()) and ran != child.pid
    assert seen == {"child": f"child process {child.pid} (sleep 30)", "run": f"child process {ran} (sleep 30)",
                    "lock": "lock", "sleep": ""}  # fmt: skip
    held.release()
    child.kill()
    os.kill(ran, signal.SIGKILL)
    child.wait(timeout=10)
    threads["run"].join(timeout=10)


def test_every_process_below_a_rank_is_found_and_killed_grandchildren_too():
    """A tool a rank started that started its own (a shell and its two sleeps): all three found, all killed."""
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    time.sleep(0.3)
    below = launched.descendants(shell.pid)
    assert len(below) == 2 and all(frozen._state(pid) in ("S", "R") for pid in below)
    assert set(below) < set(launched.descendants(os.getpid()))  # grandchildren of this process
    launched.kill_below(shell.pid)
    assert shell.wait(timeout=10) == 0  # its wait returned: both sleeps were killed
    assert launched.descendants(shell.pid) == []


def test_a_rank_waiting_for_its_child_is_said_to_with_the_childs_fix():
    report = RankReport(1, 0.0, "busy", "", 's.py:17 training_step: subprocess.run(["sleep", "3600"])', 3,
                        "training_step", [])  # fmt: skip
    waiting = RankReport(0, 0.0, "collective", "", "", 3, "backward", [])
    states = {0: {"rank": 0, "stopped_s": 12.0, "report": waiting.as_json(), "stack": []},
              1: {"rank": 1, "stopped_s": 12.0, "report": report.as_json(), "stack": [],
                  "waits_on": "child process 77 (sleep 3600)"}}  # fmt: skip
    line = waiting_line(states, 2)
    assert "outside any collective, waiting for its child process 77 (sleep 3600);" in line, line
    assert line.endswith(f" -> {FIX_CHILD}") and "hung" not in line


def test_a_rank_on_a_lock_is_said_to_wait_on_it_with_the_locks_fix():
    report = RankReport(1, 0.0, "busy", "", "s.py:19 training_step: with LOCK:", 3, "training_step", [])
    waiting = RankReport(0, 0.0, "collective", "", "", 3, "backward", [])
    states = {0: {"rank": 0, "stopped_s": 12.0, "report": waiting.as_json(), "stack": []},
              1: {"rank": 1, "stopped_s": 12.0, "report": report.as_json(), "stack": [],
                  "waits_on": "lock"}}  # fmt: skip
    line = waiting_line(states, 2)
    assert ("rank 1 has been at s.py:19 training_step: with LOCK: for 12 s (step 3, training_step), outside any "
            "collective, in a wait with no timeout on a lock of its own process") in line, line  # fmt: skip
    assert line.endswith(f" -> {FIX_LOCK}")
    states[1]["waits_on"] = ""
    assert FIX_LOCK not in waiting_line(states, 2)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_rank_that_holds_the_gil_is_named_at_its_line_and_left_running_by_none():
    """Lightning's ``ddp`` launcher with lit_ddp's callbacks: rank 1 in ``sum(range(10**11))`` is named by rank 0's
    watchdog, the timeout's line says the same, and rank 0 kills it when it fails (Lightning would not)."""
    result = run_case(load("rank1_holds_the_gil"), timeout_s=15, settle_s=2.0)
    assert result.code == 1 and result.left == 0, result.output[-3000:]
    assert result.verdict.named_at is not None and not result.verdict.problems, result.output[-3000:]
    last = [line for line in result.output.splitlines() if "never arrived" in line][-1]
    assert "rank 1 has been at rank1_holds_the_gil.py:16 training_step: sum(range(10**11))" in last, last
    assert "exited with code" not in result.output  # it was killed, not named as dead


def test_at_the_timeout_a_rank_outside_any_collective_is_said_from_its_last_state_with_its_fix():
    from lit_ddp.analysis.stopped import FIX_CHILD, FIX_LONGER, FIX_WORKER, said_at_the_timeout

    report = RankReport(1, 0.0, "busy", "", "s.py:9 training_step: work()", 3, "training_step", [])
    state = {"rank": 1, "stopped_s": 40.0, "report": report.as_json(), "stack": []}
    doing = "has been at s.py:9 training_step: work() for 40 s (step 3, training_step), outside any collective"
    assert said_at_the_timeout(state) == (doing, FIX_LONGER)
    assert said_at_the_timeout({**state, "waits_on": "lock"})[1] == FIX_LOCK
    child = said_at_the_timeout({**state, "waits_on": "child process 7 (sleep 9)"})
    assert child == (f"{doing}, waiting for its child process 7 (sleep 9)", FIX_CHILD)
    assert said_at_the_timeout({**state, "worker": "DataLoader worker 0 (pid 8)"})[1] == FIX_WORKER
