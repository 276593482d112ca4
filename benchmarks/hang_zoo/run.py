"""One run of one zoo case: the job in a session of its own, its output read line by line with the time each line
came, a deadline, and what it left behind found by scanning /proc for that session (then killed).

    from benchmarks.hang_zoo.run import load, run_case
    result = run_case(load("rank1_sleeps"), timeout_s=40)
"""

import importlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from benchmarks.common import ROOT, child_env
from benchmarks.hang_zoo.expect import Hang, Healthy, Verdict, judge, source_line

CASES_DIR = Path(__file__).with_name("cases")
PACKAGE = "benchmarks.hang_zoo.cases"
GRACE_S = 60.0  # past the process group's timeout, for the ranks' own diagnosis and exit, before the runner kills
SETTLE_S = 5.0  # after the job's exit: its children still ending are not counted as left
# The namespace nodes' names (nodes/cluster.sh's LIT_DDP_NODES_PREFIX): "zoo-", apart from the tests' and the
# benchmarks', unless LIT_DDP_NODES_PREFIX says otherwise (two zoos at once on one machine).
NODES_PREFIX = os.environ.get("LIT_DDP_NODES_PREFIX", "zoo-")
CLUSTER_SH = ROOT / "nodes" / "cluster.sh"


@dataclass(frozen=True)
class Case:
    name: str
    thread: str  # the public threads its docstring cites: "Lightning#11841", "pytorch#141069"
    expect: Union[Hang, Healthy]
    script: Path
    command: tuple[str, ...]  # after ``python``; "{timeout_s}" is replaced
    nodes: tuple[int, ...] = ()  # the namespace nodes it runs on (each a node of its own); () on this machine


@dataclass
class Result:
    case: Case
    code: Optional[int]  # None: killed at the runner's deadline
    verdict: Verdict
    started: float  # when the job started (time.time())
    hang_start: Optional[float]  # the earliest mark of the case (hang_starts)
    ended: float
    left: int  # processes of its session still there SETTLE_S after its exit
    output: str

    def named_s(self) -> Optional[float]:
        if self.verdict.named_at is None:
            return None
        return self.verdict.named_at - (self.hang_start or self.started)

    def exit_s(self) -> float:
        """From the hang's start (a healthy case: from the job's start) to its exit."""
        return self.ended - (self.hang_start or self.started)


def names() -> list[str]:
    return sorted(p.stem for p in CASES_DIR.glob("*.py") if p.stem != "__init__")


def load(name: str) -> Case:
    module = importlib.import_module(f"{PACKAGE}.{name}")
    threads = re.findall(r"(?:[\w.-]+/)?[\w.-]*#\d+", " ".join((module.__doc__ or "").split()))
    command = tuple(getattr(module, "COMMAND", ("-m", module.__name__)))
    if isinstance(module.EXPECT, Hang) and module.EXPECT.line:
        source_line(Path(module.__file__), module.EXPECT.line)  # a case whose line is not in its file fails here
    return Case(name, ", ".join(dict.fromkeys(threads)), module.EXPECT, Path(module.__file__), command,
                tuple(getattr(module, "NODES", ())))  # fmt: skip


def session_pids(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def kill_session(sid: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def node_command(k: int, command: tuple[str, ...]) -> list[str]:
    """``command`` on namespace node ``k`` under Lightning's launcher: node 0 (198.18.0.1) hosts the rendezvous."""
    return ["ip", "netns", "exec", f"{NODES_PREFIX}node{k}", "env", "MASTER_ADDR=198.18.0.1", "MASTER_PORT=29500",
            f"NODE_RANK={k}", "GLOO_SOCKET_IFNAME=eth0", sys.executable, *command]  # fmt: skip


def cluster(action: str, *args: str) -> None:
    """``nodes/cluster.sh ACTION ARGS`` with the zoo's prefix (as root)."""
    env = {**os.environ, "LIT_DDP_NODES_PREFIX": NODES_PREFIX}
    subprocess.run(["bash", str(CLUSTER_SH), action, *args], env=env, check=action == "start", timeout=120,
                   capture_output=True)  # fmt: skip


def run_case(case: Case, timeout_s: float, log_dir: Optional[Path] = None, settle_s: float = SETTLE_S) -> Result:
    """Runs ``case`` with the process group's timeout ``timeout_s``, killed at ``timeout_s + GRACE_S``; what its
    session still runs ``settle_s`` after it exited is counted as left, and killed."""
    command = [part.replace("{timeout_s}", f"{timeout_s:g}") for part in case.command]
    with tempfile.TemporaryDirectory(prefix=f"zoo-{case.name}-") as cwd:
        env = child_env(HANG_ZOO_DIR=cwd, HANG_ZOO_TIMEOUT_S=f"{timeout_s:g}", PYTHONUNBUFFERED="1")
        argvs = [node_command(k, tuple(command)) for k in case.nodes] if case.nodes else [[sys.executable, *command]]
        lines: list[tuple[float, str]] = []
        started = time.time()
        jobs = [subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True, text=True, errors="replace") for argv in argvs]  # fmt: skip
        readers = [threading.Thread(target=_read, args=(job, lines), daemon=True) for job in jobs]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout_s + GRACE_S
        codes: list[Optional[int]] = []
        for job in jobs:
            try:
                codes.append(job.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                kill_session(job.pid)
                job.wait()
                codes.append(None)
        ended = time.time()
        for reader in readers:
            reader.join(timeout=5)
        time.sleep(settle_s)
        left = sum(len(session_pids(job.pid)) for job in jobs)
        for job in jobs:
            kill_session(job.pid)
        marks = [float(p.read_text()) for p in Path(cwd).glob("start-*")]
    code = next((c for c in codes if c != 0), 0) if None not in codes else None
    lines.sort(key=lambda line: line[0])
    output = "\n".join(text for _, text in lines)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{case.name}.log").write_text(output + "\n")
    verdict = judge(case.expect, case.script, lines, code)
    return Result(case, code, verdict, started, min(marks) if marks else None, ended, left, output)


def _read(job: subprocess.Popen, lines: list[tuple[float, str]]) -> None:
    assert job.stdout is not None
    for text in job.stdout:
        lines.append((time.time(), text.rstrip("\n")))
