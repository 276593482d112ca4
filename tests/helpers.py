"""Helpers for tests that start real processes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args: str, cwd: Path, timeout: float = 90, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m <args>`` in a fresh process (the real ``ddp`` launcher), with a hard timeout that also
    kills every process the command started (its own session), so a hung rank never outlives the test."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        try:  # ranks that outlived their launcher
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
