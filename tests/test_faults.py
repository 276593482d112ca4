"""A rank that fails, dies or hangs ends the whole job, fast, with nothing left behind.

These run the real ``ddp`` launcher (``python -m lit_ddp.fit``) in a subprocess and inject the fault into one
rank with a test-only callback (``tests/faults.py``) or a signal.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import LossMonitor
from tests.faults import NaNOnRank
from tests.helpers import ROOT, run_module

LONG_RUN = ["--devices", "2", "--model.dim", "64", "--trainer.max_steps", "100000", "--loss_monitor.every_n_steps", "0",
            "--sync_check.every_n_steps", "0", "--trainer.logger", "false"]  # fmt: skip


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def start_long_run(tmp_path, *extra: str) -> tuple[subprocess.Popen, int]:
    """Starts a long 2-rank run; returns it and rank 1's pid once rank 1 is running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lit_ddp.fit", *LONG_RUN, *extra],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = children(proc.pid)
        if kids:
            time.sleep(8)  # let both ranks import, rendezvous and train a while
            return proc, kids[0]
        time.sleep(0.2)
    proc.kill()
    pytest.fail("rank 1 never started")


def wait_gone(proc: subprocess.Popen, pids: list[int], timeout: float) -> int:
    code = proc.wait(timeout=timeout)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "a rank was left behind"
    return code


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", ["rank0", "rank1"])
def test_sigkill_of_any_rank_ends_the_job(tmp_path, victim):
    proc, rank1 = start_long_run(tmp_path)
    start = time.monotonic()
    os.kill(proc.pid if victim == "rank0" else rank1, signal.SIGKILL)
    code = wait_gone(proc, [proc.pid, rank1], timeout=60)
    assert code != 0
    assert time.monotonic() - start < 60


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["raise", "exit"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_failing_rank_ends_the_job(tmp_path, how, rank):
    start = time.monotonic()
    result = run_module("lit_ddp.fit", "--devices", "2", "--model.dim", "64", "--trainer.max_steps", "50",
                        "--trainer.callbacks+=tests.faults.FailOnRank",
                        f"--trainer.callbacks.rank={rank}", f"--trainer.callbacks.how={how}",
                        cwd=tmp_path, timeout=120)  # fmt: skip
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    if how == "raise":
        assert f"injected failure on rank {rank}" in result.stderr
    if rank == 1:  # rank 0 itself often sees only "connection reset by peer"
        assert re.search(r"^lit-ddp-fit: rank 1 exited with code [1-9]", result.stderr, re.M), result.stderr[-1500:]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_hung_rank_ends_the_job_after_the_timeout(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "lit_ddp.fit", "--devices", "2", "--model.dim", "64", "--trainer.max_steps", "50",
         "--trainer.strategy.timeout_s", "10", "--trainer.callbacks+=tests.faults.FailOnRank",
         "--trainer.callbacks.how=hang"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    start = time.monotonic()
    kids: list[int] = []
    while not kids and time.monotonic() - start < 60:
        kids = children(proc.pid)
        time.sleep(0.2)
    code = wait_gone(proc, [proc.pid, *kids], timeout=10 + 60 + 30)
    assert code != 0


def test_nan_on_one_rank_stops_every_rank_at_that_step(make_trainer):
    trainer = make_trainer(max_steps=6, callbacks=[NaNOnRank(rank=1, step=2), LossMonitor()])
    with pytest.raises(Exception, match=re.escape("loss is nan at step 2: non-finite on rank(s) [1]")):
        trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigterm_stops_every_rank_writes_a_checkpoint_and_exits_143(tmp_path):
    import torch

    proc, rank1 = start_long_run(tmp_path, "--checkpoint.every_n_steps", "1000000")
    proc.send_signal(signal.SIGTERM)
    code = wait_gone(proc, [proc.pid, rank1], timeout=60)
    assert code == 143
    assert "lit-ddp-fit: stopped by SIGTERM" in proc.stdout.read()
    checkpoint = torch.load(tmp_path / "runs" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] > 0  # written at the SIGTERM, not by the every-million-steps schedule


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "exit", "hang"])
def test_ddp_spawn_ends_when_one_rank_fails(make_trainer, how):
    """Under ddp_spawn torch's spawn watches the ranks: a rank that raises or exits ends the job at once; a
    hung one is ended by the others' collective timing out (timeout_s)."""
    from tests.faults import FailOnRank

    trainer = make_trainer(max_steps=50, callbacks=[FailOnRank(rank=1, step=2, how=how)], timeout_s=5)
    start = time.monotonic()
    with pytest.raises(Exception) as error:
        trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    assert time.monotonic() - start < 5 + 30
    if how == "hang":  # the hung rank cannot speak: rank 0 reports the timeout of its collective
        assert "Timed out" in str(error.value), str(error.value)[-500:]
    else:
        assert re.search(r"[Pp]rocess 1 |rank 1", str(error.value)), str(error.value)[:500]
