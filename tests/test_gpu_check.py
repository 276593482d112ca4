"""``benchmarks/gpu_check.py`` where no GPU is needed: it refuses a machine without CUDA in one line, and its
trace bookkeeping sorts hand-made events (the GPU run itself is the check, not a test)."""

import os
import subprocess
import sys

import pytest
import torch
from torch.autograd import DeviceType

from benchmarks.gpu_busy import gpu_activity
from lit_ddp.callbacks.kernels import MARK_PREFIX, TraceEvent
from tests.runner import ROOT, pythonpath


def event(name: str, start: float, end: float, device=DeviceType.CUDA, annotation=False) -> TraceEvent:
    return TraceEvent(name, device, start, end, thread=1, correlation_id=0, linked_correlation_id=0,
                      is_user_annotation=annotation)  # fmt: skip


def test_markers_are_found_by_their_gpu_annotations_and_left_out_of_the_work():
    events = [
        event(f"{MARK_PREFIX}1:start", 0.0, 0.5, device=DeviceType.CPU, annotation=True),  # the CPU-side range
        event(f"{MARK_PREFIX}2:forward_start", 1.0, 1.01, annotation=True),
        event("fill kernel", 1.0, 1.01),  # marker 2's kernel
        event(f"{MARK_PREFIX}1:start", 0.1, 0.11, annotation=True),
        event("fill kernel", 0.1, 0.11),  # marker 1's kernel
        event("gemm", 1.1, 2.0),
        event("DistributedDataParallel.forward", 1.05, 2.5, annotation=True),
        event("Memcpy DtoD", 2.1, 2.2),
        event("aten::addmm", 1.05, 1.09, device=DeviceType.CPU),
    ]
    gpu = gpu_activity(events)
    assert [label for label, _, _ in gpu.markers] == ["1:start", "2:forward_start"]
    assert gpu.kernels == [(1.1, 2.0), (2.1, 2.2)]
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
