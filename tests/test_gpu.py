"""The GPU path as a user meets it (skipped without CUDA): ``python -m lit_ddp.fit`` on one GPU prints the CPU's
losses and no warning, the profile config times with CUDA events and reports GPU-busy time, SyncCheck stops a
run whose all-reduce was removed, and a checkpoint written on the GPU resumes bit-exact there.

CUDA-only unit tests live beside their subject (``test_kernels``, ``test_phase_timer``, ``test_sync_check``,
``test_comm_monitor``)."""

import re

import pytest
import torch

from lit_ddp.measure import roofline
from lit_ddp.records import schema as record
from tests.runner import ROOT, run_fit, step_losses
from tests.trainers import assert_same_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ONE_GPU = ("--devices", "1")
NOOP_HOOK = "torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks.noop_hook"


@pytest.mark.timeout(300)
def test_main_job_on_one_gpu_prints_the_cpu_losses_and_no_warning(tmp_path):
    gpu = run_fit(*ONE_GPU, cwd=tmp_path, accelerator="gpu", timeout=150)
    cpu = run_fit(*ONE_GPU, cwd=tmp_path, accelerator="cpu", timeout=150)
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert len(step_losses(gpu.stdout)) == 5
    assert step_losses(gpu.stdout) == pytest.approx(step_losses(cpu.stdout), abs=1e-4)
    assert re.search(r"^Done: 5 steps on 1 rank, backend nccl, device cuda,", gpu.stdout, re.M), gpu.stdout
    output = gpu.stdout + gpu.stderr
    assert not re.search(r"warn", output, re.I), output  # device_id given; DDP built on the stream it runs on


@pytest.mark.timeout(200)
def test_profile_config_times_with_cuda_events_and_reports_gpu_busy_time(tmp_path):
    config = str(ROOT / "configs" / "mini_train_profile.yaml")
    result = run_fit("--config", config, *ONE_GPU, cwd=tmp_path, accelerator="gpu", timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Phase times (cuda_event: device time between the marks, idle gaps included), 1 rank(s)" in out, out
    assert ("then 6 steady step(s) (steps 2-4 ran under the profiler for the GPU-busy column, left out of the "
            "others)") in out, out  # fmt: skip
    assert "GPU busy (rank 0)" in out
    phases, comm = record.load_run(tmp_path / "runs" / "mini_train_profile" / "version_0")
    assert phases.meta.clock == comm.meta.clock == "cuda_event"
    assert phases.meta.device_name == torch.cuda.get_device_name()
    # kernel_steps is 3 on CUDA: steps 2-4 profiled, their GPU-busy time kept, left out of every summary.
    assert phases.profiled_steps == comm.profiled_steps == [2, 3, 4]
    assert [row.step for row in phases.ranks[0].busy_ms] == [2, 3, 4]
    assert all(row.ms.step > 0 for row in phases.ranks[0].busy_ms)
    assert phases.ranks[0].summaries["step"].count == comm.ranks[0].summaries["total_ms"].count == 6
    assert re.search(r"^Verdict: (GPU|host)-bound: the GPU was busy \d+% of the step", out, re.M), out
    if roofline.peak_for(torch.cuda.get_device_name(), torch.float32):  # a known GPU: "of peak" is filled in
        assert re.search(r"^forward .* \d+\.\d%$", out, re.M), out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one GPU")
@pytest.mark.timeout(200)
def test_sync_check_passes_on_gpus_and_stops_a_run_without_all_reduce(tmp_path):
    synced = run_fit("--devices", "2", cwd=tmp_path, accelerator="gpu", timeout=150)
    assert synced.returncode == 0, synced.stderr[-3000:]
    assert "weights in sync across 2 ranks after step 4: max |diff| = 0" in synced.stdout
    broken = run_fit("--devices", "2", "--trainer.strategy.ddp_comm_hook", NOOP_HOOK, cwd=tmp_path,
                     accelerator="gpu", timeout=150)  # fmt: skip
    assert broken.returncode == 1
    assert re.search(r"^lit-ddp-fit: SyncError: weights out of sync across 2 ranks after step 0", broken.stderr,
                     re.M), broken.stderr[-2000:]  # fmt: skip


@pytest.mark.timeout(400)
def test_checkpoint_written_on_gpu_resumes_bit_exact(tmp_path):
    args = (*ONE_GPU, "--model.dim", "256")
    runs = [
        ("straight", "10", ()),
        ("resumed", "5", ()),
        ("resumed", "10", ("--ckpt_path", "last")),
    ]
    for name, steps, extra in runs:
        result = run_fit(*args, "--trainer.max_steps", steps, "--checkpoint.every_n_steps", steps,
                         "--trainer.logger.init_args.name", name, *extra, cwd=tmp_path, accelerator="gpu",
                         timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    assert "Step 5, Loss" in result.stdout and "Step 4, Loss" not in result.stdout
    assert_same_checkpoint(tmp_path / "runs/straight/checkpoints/last.ckpt",
                           tmp_path / "runs/resumed/checkpoints/last.ckpt", global_step=10)  # fmt: skip
