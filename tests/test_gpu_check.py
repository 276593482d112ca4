"""``benchmarks/gpu_check.py`` where no GPU is needed: it refuses a machine without CUDA in one line, and its
trace bookkeeping sorts hand-made Chrome-trace events (the GPU run itself is the check, not a test)."""

import os
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_busy import gpu_activity
from lit_ddp.records.ranges import STEP_PREFIX
from tests.runner import ROOT, pythonpath


def event(cat: str, name: str, start_ms: float, end_ms: float) -> dict:
    """A Chrome trace event (times in us, as kineto writes them)."""
    return {"ph": "X", "cat": cat, "name": name, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3}


def test_steps_are_found_by_their_gpu_annotations_and_kernels_by_category():
    events = [
        event("user_annotation", f"{STEP_PREFIX}2", 0.0, 0.5),  # the CPU-side range
        event("gpu_user_annotation", f"{STEP_PREFIX}3", 2.5, 3.0),
        event("gpu_user_annotation", f"{STEP_PREFIX}2", 1.0, 2.2),  # from its first GPU op to its last
        event("kernel", "gemm", 1.1, 2.0),
        event("gpu_user_annotation", "DistributedDataParallel.forward", 1.05, 2.5),
        event("gpu_memcpy", "Memcpy DtoD", 2.1, 2.2),
        event("cpu_op", "aten::addmm", 1.05, 1.09),
        {"ph": "i", "cat": "kernel", "name": "an instant, no duration", "ts": 5.0},
    ]
    gpu = gpu_activity(events)
    assert gpu.steps == [(f"{STEP_PREFIX}2", 1.0, 2.2), (f"{STEP_PREFIX}3", 2.5, 3.0)]  # in step order
    assert gpu.kernels == [(1.1, 2.0), (2.1, pytest.approx(2.2))]
    assert [name for name, _, _ in gpu.annotations] == ["DistributedDataParallel.forward"]


def _without_repository(pythonpath: str) -> str:
    return os.pathsep.join(p for p in pythonpath.split(os.pathsep) if p and os.path.realpath(p) != str(ROOT))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("how", ["file", "module"])
def test_without_cuda_it_exits_2_in_one_line_and_writes_nothing(tmp_path, how):
    out = tmp_path / "gpu_check.txt"
    if how == "file":  # finds the repository itself: not on PYTHONPATH
        command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")]
        env = {**os.environ, "PYTHONPATH": _without_repository(os.environ.get("PYTHONPATH", ""))}
    else:
        command = [sys.executable, "-m", "benchmarks.gpu_check"]
        env = {**os.environ, "PYTHONPATH": pythonpath()}
    result = subprocess.run([*command, str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("gpu_check: error: no CUDA device") and len(result.stderr.splitlines()) == 1
    assert not out.exists()


def test_every_section_runs_a_function_of_its_own_module():
    """The sections are imported when they run (the refusal without CUDA comes before Lightning's import): each
    name leads to its module's function."""
    from benchmarks import gpu_check

    for name in gpu_check.SECTIONS:
        section = gpu_check.runner(name)
        assert callable(section) and section.__module__ == f"benchmarks.gpu_{name}", name


def test_gpu_session_fits_one_device_call_with_the_gpu_tests_first():
    """``benchmarks/gpu_session.sh run``: its steps' limits, each with its kill grace, add up to no more than its
    budget, the budget leaves room in a 560 s device call, and the GPU tests run before the check and the suite."""
    import re

    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    budget = int(re.search(r"^BUDGET_S=(\d+)", script, re.M).group(1))
    grace = int(re.search(r"^KILL_AFTER_S=(\d+)", script, re.M).group(1))
    steps = re.findall(r'^\s+step (nvidia-smi|"[^"]+"|\w+) (\d+) ', script, re.M)
    names = [name.strip('"') for name, _ in steps]
    assert names == ["nvidia-smi", "GPU tests", "gpu_check", "default suite"], names
    assert sum(int(limit) + grace for _, limit in steps) <= budget <= 560 - 15, (steps, budget)
    result = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True,
                            text=True, timeout=30)  # fmt: skip
    assert result.returncode == 0, result.stderr
