"""Shared fixtures: the fast CPU trainer factory, clean-up that keeps tests independent, and the runs that tests of
several files read (each started once a test run), and the turns of the timing tests under pytest-xdist."""

import fcntl
import functools
import gc
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from tests.runner import PROFILE_RUN, ROOT, FitRun, run_fit
from tests.trainers import fast_trainer

# The in-process tests fork their ranks from this process (tests/trainers.py), as `python -m lit_ddp.fit` does on
# CPUs: no second round of importing torch and Lightning, ~3 s a rank. A forked child that enters an OpenMP
# parallel region hangs when its parent had started GNU OpenMP's thread pool, so this process never starts one: one
# intra-op thread, and OMP_NUM_THREADS set so that Lightning's launchers (which raise the count when it is unset)
# leave it at that. Processes the tests start inherit it; two ranks on a 2-core machine had one thread each anyway.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

# What Lightning's launchers write into os.environ, as the session started. A module- or session-scoped fixture that
# starts ranks sets them before the per-test snapshot below is taken: a later run would take that MASTER_PORT again,
# where the store of an in-process run that ended in an exception can still listen (kept by its traceback until
# garbage collection): "Address already in use".
_LAUNCHER_ENV = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK",
                                                         "WORLD_SIZE")}  # fmt: skip

# Threads of a process group and its store (gloo's loops, the TCPStore's): alive in this process after an in-process
# run whose objects outlive it, kept by an exception's traceback until garbage collection. A rank forked while one of
# them holds a lock can hang: both ranks of a PhaseTimer run waited in deepcopy for minutes, forked beside the
# threads of test_memory's in-process out-of-memory run.
_GROUP_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")


def _group_threads() -> list[str]:
    """The names of this process's process-group threads (none where /proc is not there to tell)."""
    names = []
    tasks = "/proc/self/task"
    for task in os.listdir(tasks) if os.path.isdir(tasks) else ():
        try:
            with open(f"{tasks}/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names += [name] if name.startswith(_GROUP_THREADS) else []
    return names


# Loggers that `lit_ddp.run.console.setup` (run by an in-process `main()`) points at the stdout of its time, a
# capsys buffer that is closed after its test.
_CONFIGURED_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lit_ddp", "torch.multiprocessing.spawn")


@pytest.fixture(autouse=True)
def _restore_env_and_process_group():
    """Lightning's launchers write MASTER_ADDR/PORT, WORLD_SIZE, LOCAL_RANK... into os.environ, and a Trainer
    built as some rank (a simulated Slurm rank 3) sets the rank that rank_zero_info obeys in this process;
    undo both. A process group of an in-process run goes, threads and all, before the next test forks ranks."""
    for name, value in _LAUNCHER_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    env = dict(os.environ)
    ranks = rank_zero_only.rank, utils_rank_zero_only.rank
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if _group_threads():
        gc.collect()  # the group's and the store's destructors join their threads
    os.environ.clear()
    os.environ.update(env)
    rank_zero_only.rank, utils_rank_zero_only.rank = ranks


@pytest.fixture(autouse=True)
def _restore_logging():
    saved = {}
    for name in _CONFIGURED_LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


class _Turns:
    """Under pytest-xdist: a ``timing`` test runs alone (an exclusive lock), every other test beside the others (a
    shared one). A turnstile, taken first by everyone and held by a ``timing`` test until its turn comes, keeps new
    shared holders from starving it. A worker's consecutive ``timing`` tests keep the exclusive lock from the first
    to the last: the wait for the other workers to end the tests they are running (a minute and more) comes once."""

    def __init__(self) -> None:
        self.files: tuple | None = None  # (turnstile, lock), open for the worker's whole session
        self.exclusive = False

    def take(self, exclusive: bool) -> None:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if not run or (exclusive and self.exclusive):  # not under xdist, or held since the last timing test
            return
        if self.files is None:
            base = Path(tempfile.gettempdir()) / f"lit_ddp_tests_{run}"
            base.mkdir(exist_ok=True)
            self.files = (open(base / "turnstile", "a"), open(base / "lock", "a"))
        turnstile, lock = self.files
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        self.exclusive = exclusive

    def give_back(self, keep: bool) -> None:
        """Releases the lock, unless ``keep`` (a timing test that another timing test follows)."""
        if self.files is not None and not (self.exclusive and keep):
            fcntl.flock(self.files[1], fcntl.LOCK_UN)
            self.exclusive = False


_TURNS = _Turns()


def _timing(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("timing") is not None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked ``timing`` measure who is late by how much on 2 cores: another worker's run beside them would
    be the straggler they find. The wait for a turn comes before the test's timeout starts (pytest-timeout's
    timer is set inside this hook), and a session run is made inside the turn of the test that first asks for it."""
    _TURNS.take(_timing(item))
    try:
        yield
    finally:
        _TURNS.give_back(keep=_timing(item) and _timing(nextitem))


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(devices=2, max_steps=5, callbacks=[...], **strategy_kwargs)``: ``fast_trainer`` in
    ``tmp_path``."""
    return functools.partial(fast_trainer, tmp_path)


def _session_run(tmp_path_factory, name: str, make: Callable[[Path], subprocess.CompletedProcess]) -> FitRun:
    """``make(cwd)`` once for the whole test run: under pytest-xdist every worker has its own session, and the first
    to ask makes the run (the others wait for it, on a file lock) in the workers' shared temporary directory."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        cwd = tmp_path_factory.mktemp(name)
        return FitRun(make(cwd), cwd)
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, the parent of every worker's popen-gwK/
    cwd, saved = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.is_file():
            cwd.mkdir()
            try:
                result = make(cwd)
            except BaseException as e:  # a timeout, an interrupt: the other workers' tests say so, not mkdir's error
                saved.write_text(json.dumps({"error": f"{name} failed in {os.environ['PYTEST_XDIST_WORKER']}: {e!r}"}))
                raise
            saved.write_text(json.dumps({key: getattr(result, key) for key in ("args", "returncode", "stdout",
                                                                                 "stderr")}))  # fmt: skip
    done = json.loads(saved.read_text())
    if "error" in done:
        pytest.fail(done["error"])
    return FitRun(subprocess.CompletedProcess(**done), cwd)


@pytest.fixture(scope="session")
def notes_run(tmp_path_factory) -> FitRun:
    """README's command 1 on the CPU: ``python -m lit_ddp.fit --devices 2``, the notes' run (dim 1024, 5 steps), in a
    directory of its own; for the tests that read its output, its metrics or its run directory."""
    return _session_run(tmp_path_factory, "notes_run", lambda cwd: run_fit("--devices", "2", cwd=cwd))


@pytest.fixture(scope="session")
def pytorch_profiler_run(tmp_path_factory) -> FitRun:
    """A 2-rank run (dim 64, 8 steps) under Lightning's PyTorchProfiler (``--trainer.profiler pytorch``: one Chrome
    trace per rank in the run directory), with a PhaseTimer that asks for a profile of its own (``kernel_steps=2``)."""

    def make(cwd: Path) -> subprocess.CompletedProcess:
        config = cwd / "profiled.yaml"
        config.write_text("trainer:\n  max_steps: 8\n  callbacks:\n    - class_path: lit_ddp.callbacks.PhaseTimer\n"
                          "      init_args: {kernel_steps: 2, print_steps: 0}\nmodel:\n  dim: 64\n")  # fmt: skip
        return run_fit("--config", str(config), "--devices", "2", "--trainer.profiler", "pytorch", cwd=cwd,
                       timeout=120)  # fmt: skip

    return _session_run(tmp_path_factory, "pytorch_profiler_run", make)


@pytest.fixture(scope="session")
def profile_run(tmp_path_factory) -> FitRun:
    """The notes' profiled variant, ``python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2``
    (``tests.runner.PROFILE_RUN``), from a directory that holds a copy of ``configs/``."""

    def make(cwd: Path) -> subprocess.CompletedProcess:
        shutil.copytree(ROOT / "configs", cwd / "configs")
        return run_fit(*PROFILE_RUN, cwd=cwd, timeout=200)

    return _session_run(tmp_path_factory, "profile_run", make)


SLOW_RANK, SLOW_MS = 2, 25.0  # straggler_run's slow rank and its delay


@pytest.fixture(scope="session")
def straggler_run(tmp_path_factory) -> FitRun:
    """Issue 50's case: the profiled config on 4 CPU ranks (dim 256, 16 steps, steps 2-4 under torch.profiler), rank
    ``SLOW_RANK`` ``SLOW_MS`` slow inside its backward (``tests.slow_ranks.SleepInHook``); for the timeline's
    tests, which read its record, its traces and the timeline drawn from them."""

    def make(cwd: Path) -> subprocess.CompletedProcess:
        shutil.copytree(ROOT / "configs", cwd / "configs")
        return run_fit(*PROFILE_RUN[:2], "--devices", "4", "--model.dim", "256", "--trainer.max_steps", "16",
                       "--loss_monitor.every_n_steps", "0", "--trainer.callbacks+=tests.slow_ranks.SleepInHook",
                       f"--trainer.callbacks.rank={SLOW_RANK}", "--trainer.callbacks.hook=on_before_backward",
                       f"--trainer.callbacks.delay_ms={SLOW_MS:g}", cwd=cwd, timeout=240)  # fmt: skip

    return _session_run(tmp_path_factory, "straggler_run", make)
