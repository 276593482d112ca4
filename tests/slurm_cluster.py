"""The one-node Slurm that the ``slurm`` tests run on, and Slurm's commands as the tests run them.

    slurm/cluster.sh start && pytest -m slurm      # or let the tests start it (as root, Slurm installed)

The tests use the cluster ``slurm/cluster.sh start`` brought up (``.ci/run`` does); else they start one for the
session where this machine can (root, slurm-wlm and munge installed: ``start --no-install``) and stop it after;
else they skip with the script's one-line reason, or fail with it when ``LIT_DDP_SLURM_REQUIRED=1`` (CI). Every
job a test submits has a name of its own and is cancelled, and waited for, when the test ends.
"""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runner import ROOT, Running, fit_command, pythonpath

CLUSTER_SH = ROOT / "slurm" / "cluster.sh"
# Two tasks on the one node, one CPU each: the main job's shape (--devices 2).
TWO_TASKS = ("--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1")


@dataclass(frozen=True)
class Cluster:
    conf: str  # its slurm.conf: SLURM_CONF of every command
    started_here: bool  # stopped again when the tests are done

    @property
    def env(self) -> dict[str, str]:
        """The environment of Slurm's commands, and through them of the jobs (Slurm passes it on): this Python
        first on PATH (a batch script's ``python``), the repository importable, output unbuffered."""
        path = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
        return {**os.environ, "SLURM_CONF": self.conf, "PATH": path, "PYTHONPATH": pythonpath(),
                "PYTHONUNBUFFERED": "1"}  # fmt: skip

    def command(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A short Slurm command (``squeue``, ``scancel``, ``scontrol``, ``sbatch``), text output."""
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode:
            pytest.fail(f"{' '.join(argv)} exited with {result.returncode}: {result.stderr.strip()}")
        return result

    @contextmanager
    def job_name(self) -> Iterator[str]:
        """A job name of the test's own for the ``with`` block; afterwards every job of that name is killed,
        cancelled and waited for (gone from ``squeue``), whatever happened."""
        name = f"lit-ddp-test-{uuid.uuid4().hex[:8]}"
        try:
            yield name
        finally:
            self.command("scancel", f"--name={name}", "--full", "--signal=KILL", check=False)
            self.command("scancel", f"--name={name}", check=False)
            deadline = time.monotonic() + 30
            while self.command("squeue", "-h", f"--name={name}", "-o", "%A").stdout.strip():
                if time.monotonic() > deadline:
                    pytest.fail(f"job {name} still in the queue 30 s after scancel")
                time.sleep(0.2)

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode...); empty once Slurm forgot the job."""
        result = self.command("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout)) if result.returncode == 0 else {}

    def wait_until_gone(self, job_id: int, timeout: float) -> dict[str, str]:
        """Waits until the job has ended (no longer pending, running or completing); its final fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
                return fields
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
            time.sleep(0.2)

    def sbatch(self, name: str, script: Path, *args: str, cwd: Path) -> int:
        """Submits ``script ARGS`` from ``cwd`` as job ``name``; its id."""
        result = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", str(script), *args], cwd=cwd,
                                env=self.env, capture_output=True, text=True, timeout=30)  # fmt: skip
        if result.returncode:
            pytest.fail(f"sbatch exited with {result.returncode}: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def srun_argv(self, name: str, *module_args: str, kill_on_bad_exit: bool = False) -> list[str]:
        """``srun`` of ``python -m MODULE_ARGS`` as two tasks of job ``name``; ``kill_on_bad_exit``: a task that
        exits non-zero ends the others (slurm/*.sbatch set it)."""
        options = ("--kill-on-bad-exit=1",) if kill_on_bad_exit else ()
        return ["srun", f"--job-name={name}", *TWO_TASKS, *options, sys.executable, "-m", *module_args]

    def srun(self, name: str, *module_args: str, cwd: Path, timeout: float = 90,
             kill_on_bad_exit: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
        """``srun_argv`` to completion, with a hard timeout (its session killed then; the job itself is
        ``job_name``'s to cancel)."""
        proc = subprocess.Popen(self.srun_argv(name, *module_args, kill_on_bad_exit=kill_on_bad_exit), cwd=cwd,
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def srun_fit(self, name: str, *fit_args: str, cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess:
        """``srun`` of the main job (on the CPU) to completion."""
        return self.srun(name, *fit_command(*fit_args), cwd=cwd, timeout=timeout)

    @contextmanager
    def start_srun_fit(self, name: str, *fit_args: str, cwd: Path) -> Iterator[Running]:
        """``srun`` of the main job in the background for the ``with`` block; its session is killed afterwards."""
        proc = subprocess.Popen(self.srun_argv(name, *fit_command(*fit_args)), cwd=cwd, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        try:
            yield Running(proc)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _cluster_sh(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout)


def bring_up() -> Cluster:
    """The running cluster, or one started now; skips (fails where required) when there can be none."""
    status = _cluster_sh("status", timeout=30)
    if status.returncode == 0:
        return Cluster(conf=status.stdout.strip().partition("SLURM_CONF=")[2], started_here=False)
    start = _cluster_sh("start", "--no-install", timeout=120)
    if start.returncode == 0:
        return Cluster(conf=start.stdout.strip().partition("SLURM_CONF=")[2], started_here=True)
    reason = (start.stderr.strip().splitlines() or [f"exit code {start.returncode}"])[-1]
    if os.environ.get("LIT_DDP_SLURM_REQUIRED") == "1":
        pytest.fail(f"no one-node Slurm, and LIT_DDP_SLURM_REQUIRED=1: {reason}")
    pytest.skip(f"no one-node Slurm here: {reason}")


def shut_down(cluster: Cluster) -> None:
    if cluster.started_here:
        stop = _cluster_sh("stop", timeout=120)
        assert stop.returncode == 0, stop.stderr
