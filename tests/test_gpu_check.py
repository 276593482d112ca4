"""``benchmarks/gpu_check.py`` where no GPU is needed: it refuses a machine without CUDA in one line, its steps are
bounded (a fake step cut at its limit, its process group ended; the budget's end skips the rest), its trace reading
sorts hand-made events, and its synchronized loop runs on the CPU. The GPU run itself is the check, not a test."""

import os
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import gpu_check
from lit_ddp.records.ranges import STEP_PREFIX
from tests.runner import ROOT, pythonpath

SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")


def _without_repository(path: str) -> str:
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and os.path.realpath(p) != str(ROOT))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("how", [("file", "run"), ("module", "check", "syncs")])
def test_without_cuda_it_exits_2_in_one_line_and_writes_nothing(tmp_path, how):
    out = tmp_path / "out"
    if how[0] == "file":  # finds the repository itself: not on PYTHONPATH
        command = [sys.executable, SCRIPT]
        env = {**os.environ, "PYTHONPATH": _without_repository(os.environ.get("PYTHONPATH", ""))}
    else:
        command = [sys.executable, "-m", "benchmarks.gpu_check"]
        env = {**os.environ, "PYTHONPATH": pythonpath()}
    result = subprocess.run([*command, *how[1:], str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("gpu_check: error: no CUDA device") and len(result.stderr.splitlines()) == 1
    assert result.stdout == "" and not out.exists()
    assert "lightning" not in result.stderr  # refused before Lightning's import


def test_help_names_the_three_commands(capsys):
    """In this process: the script's own start is the refusal test's, above."""
    with pytest.raises(SystemExit) as shown:
        gpu_check.parse_args(["--help"])
    assert shown.value.code == 0
    assert "{fetch,run,check}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        gpu_check.parse_args(["run", "out", "--only", "suite,nope"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--only: unknown step(s) nope")


def test_the_steps_run_the_gpu_tests_first_and_fit_the_budget_with_their_grace():
    steps = gpu_check.steps(ROOT / "out")
    assert [s.name for s in steps] == ["nvidia-smi", "gpu-tests", *gpu_check.CHECKS, "suite"]
    assert sum(s.limit_s + gpu_check.GRACE_S for s in steps) <= gpu_check.BUDGET_S <= 380 - 20


def test_a_step_is_cut_at_its_limit_and_its_process_group_ended(tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    code = f"import os, subprocess, sys, time; open({str(pid_file)!r}, 'w').write(str(subprocess.Popen("
    code += "[sys.executable, '-c', 'import time; time.sleep(60)']).pid)); print('started', flush=True); time.sleep(60)"
    step = gpu_check.Step("sleeper", 1, (sys.executable, "-c", code))
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)  # a 1 s limit, for a quick test
    start = time.monotonic()
    line = gpu_check.run_step(step, tmp_path, deadline=start + 100)
    assert line.startswith("gpu_check: sleeper: exit 124 after ") and line.endswith("(limit 1 s)"), line
    assert time.monotonic() - start < 30
    assert (tmp_path / "sleeper.log").read_text() == "started\n"
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2]
    assert (tmp_path / "summary.txt").read_text() == line + "\n"


def test_a_step_runs_to_its_exit_code_and_the_budget_cuts_or_skips_the_next(tmp_path):
    fails = gpu_check.Step("fails", 60, (sys.executable, "-c", "raise SystemExit(3)"))
    now = [1000.0]
    line = gpu_check.run_step(fails, tmp_path, deadline=1000.0 + 40, clock=lambda: now[0])
    assert line.startswith("gpu_check: fails: exit 3 after ") and line.endswith("(limit 35 s)"), line  # cut
    skipped = gpu_check.run_step(fails, tmp_path, deadline=1000.0 + gpu_check.MIN_STEP_S, clock=lambda: now[0])
    assert skipped == "gpu_check: fails: skipped, 10 s of the budget left"
    assert (tmp_path / "summary.txt").read_text().splitlines() == [line, skipped]


def event(cat: str, name: str, start_ms: float, end_ms: float) -> dict:
    """A Chrome trace event (times in us, as kineto writes them)."""
    return {"ph": "X", "cat": cat, "name": name, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3}


def test_steps_are_found_by_their_gpu_annotations_and_work_by_category():
    events = [
        event("user_annotation", f"{STEP_PREFIX}2", 0.0, 0.5),  # the CPU-side range
        event("gpu_user_annotation", f"{STEP_PREFIX}10", 2.5, 3.0),
        event("gpu_user_annotation", f"{STEP_PREFIX}2", 1.0, 2.2),  # from its first GPU op to its last
        event("kernel", "gemm", 1.1, 2.0),
        event("gpu_user_annotation", "DistributedDataParallel.forward", 1.05, 2.5),
        event("gpu_memcpy", "Memcpy DtoD", 2.1, 2.2),
        event("cpu_op", "aten::addmm", 1.05, 1.09),
        {"ph": "i", "cat": "kernel", "name": "an instant, no duration", "ts": 5.0},
    ]
    work, steps = gpu_check.gpu_activity(events)
    assert steps == [(2, 1.0, 2.2), (10, 2.5, 3.0)]  # in step order, not by name
    assert work == [(1.1, 2.0), (2.1, pytest.approx(2.2))]


def test_the_synchronized_loop_runs_on_cpu():
    phases = gpu_check.synchronized_phases(steps=3, warmup=1, device=torch.device("cpu"))
    assert list(phases) == ["forward", "backward", "update"] and all(ms > 0 for ms in phases.values())
