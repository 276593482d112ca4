"""Helpers for tests that start real processes."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args: str, cwd: Path, timeout: float = 90, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m <args>`` in a fresh process (the real ``ddp`` launcher), with a hard timeout."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
