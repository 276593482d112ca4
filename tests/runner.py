"""Running commands in a subprocess for the tests: to completion or in the background until a sign of training,
every process they start killed afterwards; the step-line format; free ports; ``main()`` in this process."""

import fcntl
import importlib
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The notes' step line, as LossMonitor and lit_ddp.reference print it.
STEP_LINE = re.compile(r"^Step (\d+), Loss ([0-9.]+)$", re.M)

TORCHRUN = ("torch.distributed.run",)

# Marks every process a test starts, and everything those start (launched ranks, torchrun's workers in
# their own sessions), so that clean-up finds them all.
_TAG = "LIT_DDP_TEST_RUN"


def step_numbers(stdout: str) -> list[int]:
    return [int(step) for step, _ in STEP_LINE.findall(stdout)]


def step_losses(stdout: str) -> list[float]:
    return [float(loss) for _, loss in STEP_LINE.findall(stdout)]


def fit_command(*args: str, launcher: tuple[str, ...] = (), accelerator: str | None = "cpu") -> list[str]:
    """The ``python -m`` arguments of ``lit_ddp.fit ARGS``, or of ``LAUNCHER... -m lit_ddp.fit ARGS``.

    Args:
        launcher: A module and its arguments that start ``lit_ddp.fit``, e.g. ``(*TORCHRUN, "--standalone")``.
        accelerator: ``--trainer.accelerator``; the tests mean CPU (so the suite passes unchanged on a GPU
            machine) unless they say otherwise. ``None`` leaves it to the command line and configs.
    """
    fit = ["lit_ddp.fit", *(("--trainer.accelerator", accelerator) if accelerator else ()), *args]
    return [*launcher, "-m", *fit] if launcher else fit


def pythonpath(*first: Path) -> str:
    """``first``, then the repository root, then the PYTHONPATH this process was given (where packages that are
    not installed may live, e.g. wheels unpacked on a GPU machine)."""
    return os.pathsep.join(str(p) for p in (*first, ROOT, os.environ.get("PYTHONPATH")) if p)


def _popen(
    module_args: list[str], cwd: Path, env: dict | None, wrapper: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(
        [*wrapper, sys.executable, "-m", *module_args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Unbuffered: a rank's stdout is a pipe here, block-buffered otherwise, and its lines would arrive
        # only at exit (or never, when it is killed).
        env={**os.environ, "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1", _TAG: tag, **(env or {})},
        start_new_session=True,
    )
    return proc, tag


def _kill_everything(proc: subprocess.Popen, tag: str) -> None:
    """SIGKILL the command's session and every process that carries its tag (ranks that outlived their
    launcher, torchrun's workers in sessions of their own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    needle = f"{_TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):  # gone, or not ours to read
            continue


def run_module(
    *args: str, cwd: Path, timeout: float = 90, env: dict | None = None, wrapper: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``python -m ARGS`` in a fresh process, to completion, with a hard timeout; every process it started is
    killed afterwards, so a hung rank never outlives the test. stdout and stderr are text, ``\\r`` kept.
    ``wrapper`` runs it through another command, e.g. ``("ip", "netns", "exec", "litddp-node1")``."""
    proc, tag = _popen(list(args), cwd, env, wrapper)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_everything(proc, tag)
        proc.communicate()
        raise
    finally:
        _kill_everything(proc, tag)
    return subprocess.CompletedProcess(proc.args, proc.returncode, _decode(stdout), _decode(stderr))


def run_fit(
    *args: str,
    cwd: Path,
    timeout: float = 90,
    env: dict | None = None,
    launcher: tuple[str, ...] = (),
    accelerator: str | None = "cpu",
) -> subprocess.CompletedProcess:
    """``python -m lit_ddp.fit ARGS`` (on the CPU unless told otherwise) to completion: see ``run_module``."""
    return run_module(*fit_command(*args, launcher=launcher, accelerator=accelerator), cwd=cwd, timeout=timeout,
                      env=env)  # fmt: skip


class FitRun(NamedTuple):
    """A finished ``python -m lit_ddp.fit`` that several tests read (a session fixture of ``conftest.py``), and the
    directory it ran in. Read it, do not run more there: copy ``cwd`` to go on from it."""

    result: subprocess.CompletedProcess
    cwd: Path


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def run_in_terminal(*args: str, cwd: Path, timeout: float = 90, columns: int = 80) -> subprocess.CompletedProcess:
    """``run_module`` with stdout a terminal ``columns`` wide (a pseudo-terminal), where progress bars draw live
    as a user at a shell sees them. stdout: what the terminal received, escape sequences and ``\\r\\n`` kept."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1", "COLUMNS": str(columns), "TERM": "xterm",
           _TAG: tag}  # fmt: skip
    with tempfile.TemporaryFile() as stderr:  # a file: a full pipe would block a rank while stdout is read
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave,
                                stderr=stderr, env=env, start_new_session=True)  # fmt: skip
        os.close(slave)
        chunks = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(proc.args, timeout)
                if select.select([master], [], [], min(left, 1.0))[0]:
                    try:
                        data = os.read(master, 1 << 16)
                    except OSError:  # EIO: every process that had the terminal closed it
                        break
                    if not data:
                        break
                    chunks.append(data)
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            _kill_everything(proc, tag)
            os.close(master)
        stderr.seek(0)
        stdout = _decode(b"".join(chunks))
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, _decode(stderr.read()))


class Running:
    """A command running in the background, in its own session; its output is read as it comes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._out: list[bytes] = []
        self._err: list[bytes] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, chunks), daemon=True)
            for stream, chunks in ((proc.stdout, self._out), (proc.stderr, self._err))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, chunks: list[bytes]) -> None:
        for line in iter(stream.readline, b""):
            chunks.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self) -> str:
        return _decode(b"".join(self._out))

    @property
    def stderr(self) -> str:
        return _decode(b"".join(self._err))

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        """Waits until a line of stdout matches ``pattern`` (a ``re.M`` regex); fails the test if the command
        exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None
            if exited:
                self._join(timeout=5)
            found = re.search(pattern, self.stdout, re.M)
            if found:
                return found
            if exited or time.monotonic() > deadline:
                why = f"exited with {self.proc.returncode}" if exited else f"still running after {timeout} s"
                pytest.fail(f"no line matching {pattern!r}: {why}\nstdout: {self.stdout[-2000:]}\n"
                            f"stderr: {self.stderr[-2000:]}")  # fmt: skip
            time.sleep(0.05)

    def wait_for_files(self, paths: list[Path], timeout: float = 90) -> None:
        """Waits until every path exists (and is not empty); fails the test if the command exits first."""
        deadline = time.monotonic() + timeout
        while not all(p.is_file() and p.stat().st_size for p in paths):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                missing = [str(p) for p in paths if not p.is_file()]
                pytest.fail(f"never written: {missing} (exit code {self.proc.poll()})\n{self.stderr[-2000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        """The exit code, once the command has exited and its output is read."""
        code = self.proc.wait(timeout=timeout)
        self._join(timeout=10)
        return code

    def completed(self, timeout: float) -> subprocess.CompletedProcess:
        """Once the command has exited and its output is read: as ``run_module`` returns it."""
        code = self.wait(timeout)
        return subprocess.CompletedProcess(self.proc.args, code, self.stdout, self.stderr)

    def _join(self, timeout: float) -> None:
        for reader in self._readers:
            reader.join(timeout=timeout)


@contextmanager
def start_module(*args: str, cwd: Path, env: dict | None = None, wrapper: tuple[str, ...] = ()) -> Iterator[Running]:
    """``python -m ARGS`` (through ``wrapper``, as ``run_module``) in the background for the ``with`` block;
    afterwards every process it started is killed, whatever happened."""
    proc, tag = _popen(list(args), cwd, env, wrapper)
    try:
        yield Running(proc)
    finally:
        _kill_everything(proc, tag)
        proc.wait()


@contextmanager
def start_fit(
    *args: str,
    cwd: Path,
    env: dict | None = None,
    launcher: tuple[str, ...] = (),
    accelerator: str | None = "cpu",
) -> Iterator[Running]:
    """``python -m lit_ddp.fit ARGS`` (on the CPU unless told otherwise) in the background: see ``start_module``."""
    with start_module(*fit_command(*args, launcher=launcher, accelerator=accelerator), cwd=cwd, env=env) as run:
        yield run


def run_fits(*runs: tuple[Sequence[str], Path], timeout: float = 120, **kwargs) -> list[subprocess.CompletedProcess]:
    """Several ``python -m lit_ddp.fit`` at once, each ``(args, cwd)``, to completion within ``timeout`` (each
    process killed afterwards, as ``run_module`` does); ``kwargs`` go to each ``start_fit``. A run's start-up
    (importing torch and Lightning) uses one core: on a 2-core machine a second run's overlaps it. Only for runs
    whose checks do not time anything."""
    deadline = time.monotonic() + timeout
    with ExitStack() as stack:
        started = [stack.enter_context(start_fit(*args, cwd=cwd, **kwargs)) for args, cwd in runs]
        return [run.completed(timeout=max(deadline - time.monotonic(), 0.1)) for run in started]


# A 2-rank run that goes on until it is stopped: it prints step 0 only, checks sync only after its (never
# reached) last step, and every rank writes its pid to pids/rank<r> (tests.faults.WritePid).
LONG_RUN = ("--devices", "2", "--model.dim", "64", "--trainer.max_steps", "100000",
            "--loss_monitor.every_n_steps", "100000", "--sync_check.every_n_steps", "0", "--trainer.logger", "false",
            "--trainer.callbacks+=tests.faults.WritePid")  # fmt: skip


# The notes' profiled variant as its config's header, README and docs/forecast.md run it (from a directory that holds
# configs/): Linear(4096), 10 steps, steps 2-4 under torch.profiler.
PROFILE_RUN = ("--config", "configs/mini_train_profile.yaml", "--devices", "2")


@contextmanager
def start_long_run(tmp_path: Path, *extra: str) -> Iterator[tuple[Running, list[int]]]:
    """Starts ``LONG_RUN`` in ``tmp_path``; yields it and the pids of ranks 0 and 1 once both ranks are
    training (both wrote their pid, and step 0's loss, gathered from both, is printed)."""
    with start_fit(*LONG_RUN, *extra, cwd=tmp_path) as run:
        pid_files = [tmp_path / "pids" / f"rank{rank}" for rank in (0, 1)]
        run.wait_for_files(pid_files)
        run.wait_for(r"^Step 0, Loss ")
        yield run, [int(p.read_text()) for p in pid_files]


def free_port() -> int:
    """A TCP port nobody listens on now: bound on 127.0.0.1 by the kernel's choice, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_main(monkeypatch, capsys, *args: str, command: str = "fit") -> subprocess.CompletedProcess:
    """``lit-ddp-COMMAND ARGS`` (``fit`` or ``tune``) in this process, for what launches no rank (bad input, one
    rank); the exit code and what it printed, as ``run_fit`` returns them."""
    main = importlib.import_module(f"lit_ddp.{command}").main
    prog = f"lit-ddp-{command}"
    monkeypatch.setattr(sys, "argv", [prog, *args])
    try:
        main()
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess([prog, *args], code, captured.out, captured.err)
