"""The profiled steps' traces of real 2-rank CPU runs: PhaseTimer's own (``kernel_steps`` forced on the CPU) kept in
the log dir with the tool's ranges and read by ``python -m lit_ddp.report --trace``; and with Lightning's
PyTorchProfiler on, no second profiler, its traces read instead. No GPU here: the traces hold no GPU events, so
both runs must say so and leave the GPU-busy column out (``tests/test_gpu.py`` has the GPU run)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import PhaseTimer
from lit_ddp.records import schema as record
from lit_ddp.records.phases import range_of
from lit_ddp.records.ranges import STEP_PREFIX
from tests.recorders import RecordLogs
from tests.runner import ROOT, pythonpath

BACKWARD = range_of("backward")
DATA = range_of("data")
FORWARD = range_of("forward")
OTHER = range_of("other")
UPDATE = range_of("update")

ONE_STEP = [OTHER, FORWARD, OTHER, BACKWARD, OTHER, UPDATE, OTHER, DATA]  # each step's phase ranges, in order
NO_GPU = "CPU activity only: the traces hold no GPU events, so there is no GPU-busy column"


def tool_ranges(path: Path) -> tuple[dict, list[dict]]:
    """A Chrome trace (gzipped or not): its JSON, and the tool's ``lit_ddp.*`` ranges on the CPU, in time order."""
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    ranges = [e for e in data["traceEvents"] if e.get("cat") == "user_annotation" and e["name"].startswith("lit_ddp.")]
    return data, sorted(ranges, key=lambda e: e["ts"])


def phases_of(step: dict, ranges: list[dict]) -> list[str]:
    """The names of the ranges inside ``step``, in time order."""
    end = step["ts"] + step["dur"]
    return [e["name"] for e in ranges if e is not step and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end]


@pytest.mark.timeout(120)
def test_own_profile_on_two_cpu_ranks_keeps_each_ranks_trace(make_trainer, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    trainer = make_trainer(max_steps=5, callbacks=[PhaseTimer(print_steps=0, kernel_steps=2), RecordLogs(logs)],
                           logger=CSVLogger(tmp_path, name="run", version=0))  # fmt: skip
    trainer.fit(LinearRegression(dim=64), FixedBatchDataModule(dim=64, batch_size=8))
    log_dir = tmp_path / "run" / "version_0"
    for rank in (0, 1):
        path = log_dir / "traces" / f"rank{rank}.pt.trace.json.gz"
        assert path.read_bytes()[:2] == b"\x1f\x8b", path  # gzip
        data, ranges = tool_ranges(path)
        assert (data["distributedInfo"]["rank"], data["distributedInfo"]["world_size"]) == (rank, 2)
        steps = [e for e in ranges if e["name"].startswith(STEP_PREFIX)]
        assert [e["name"] for e in steps] == [f"{STEP_PREFIX}2", f"{STEP_PREFIX}3"]  # the profiled steps only
        for step in steps:
            assert phases_of(step, ranges) == ONE_STEP, step["name"]
    phases = record.load(log_dir / "phases.json")
    assert phases.profiled_steps == [2, 3]
    assert all(rank.busy_ms == [] and rank.summaries["step"].count == 2 for rank in phases.ranks)  # steps 1, 4
    assert RecordLogs.read(logs, 0).count(NO_GPU) == 1 and NO_GPU not in RecordLogs.read(logs, 1)

    result = subprocess.run([sys.executable, "-m", "lit_ddp.report", "--trace", str(log_dir / "traces")], cwd=ROOT,
                            env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin"}, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "python -m lit_ddp.report: error: no GPU events (kernels, memcpy, memset) in 2 of 2 trace(s), CPU-only "
        "profiles: rank 0 rank0.pt.trace.json.gz, rank 1 rank1.pt.trace.json.gz"
    ]


def test_with_lightnings_pytorch_profiler_phase_timer_starts_none_and_reads_its_traces(pytorch_profiler_run):
    """kernel_steps=2 asks PhaseTimer for a profile; Lightning's profiler is on: PhaseTimer must start none (two
    at once fail), put its ranges into Lightning's traces, and read them at the end of training."""
    result, cwd = pytorch_profiler_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FIT Profiler Report" in result.stdout
    log_dir = cwd / "runs" / "mini_train" / "version_0"
    assert (f"PhaseTimer: 1 trace(s) of Lightning's PyTorchProfiler in {log_dir.relative_to(cwd)} hold no GPU "
            "events (a CPU-only profile), so there is no GPU-busy column") in result.stdout  # fmt: skip
    assert not (log_dir / "traces").exists()  # PhaseTimer profiled nothing itself
    phases = record.load(log_dir / "phases.json")
    assert phases.profiled_steps == [] and all(rank.busy_ms == [] for rank in phases.ranks)
    assert phases.ranks[0].summaries["step"].count == 7  # no step left out: PhaseTimer slowed none
    found = sorted(log_dir.glob("fit-*.pt.trace.json"))
    assert len(found) == 2
    for path in found:  # Lightning's profiler records from one training_step's end to another's: steps in between
        _, ranges = tool_ranges(path)
        steps = [e for e in ranges if e["name"].startswith(STEP_PREFIX)]
        assert len(steps) >= 2 and all(phases_of(step, ranges) == ONE_STEP for step in steps[:-1]), path.name
        assert phases_of(steps[-1], ranges) != ONE_STEP  # cut where the profiler stopped: read_busy leaves it out


@pytest.mark.timeout(120)
def test_each_buckets_all_reduce_is_a_range_inside_backward(make_trainer, tmp_path):
    from lit_ddp.callbacks import CommMonitor
    from lit_ddp.records.ranges import BUCKET_PREFIX

    trainer = make_trainer(max_steps=4, callbacks=[PhaseTimer(print_steps=0, kernel_steps=1), CommMonitor()],
                           logger=CSVLogger(tmp_path, name="run", version=0), bucket_cap_mb=0.01)  # fmt: skip
    trainer.fit(LinearRegression(dim=64, num_layers=3), FixedBatchDataModule(dim=64, batch_size=8))
    _, ranges = tool_ranges(tmp_path / "run" / "version_0" / "traces" / "rank0.pt.trace.json.gz")
    (backward,) = [e for e in ranges if e["name"] == BACKWARD]  # the one profiled step's
    inside = [name for name in phases_of(backward, ranges) if name.startswith(BUCKET_PREFIX)]
    assert sorted(inside) == [f"{BUCKET_PREFIX}{b}" for b in range(3)], inside
