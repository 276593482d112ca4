"""CommMonitor on real 2-process runs: bytes exactly as DDP's buckets, times that make sense, compression."""

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_ddp import FixedBatchDataModule, LinearRegression, report
from lit_ddp.callbacks import CommMonitor, PhaseTimer
from tests.runner import ROOT, run_fit
from tests.trainers import profile


def test_real_run_bytes_are_exact(make_trainer, tmp_path):
    _, comm, ddp, log_dir = profile(make_trainer, tmp_path, dim=1024)
    assert comm["bucket_bytes"] == [4 * (1024 * 1024 + 1024)] == [4_198_400]
    assert comm["param_bytes"] == 4_198_400
    assert comm["bucket_bytes_per_step"][0] == ddp["bucket_sizes"]  # DDP's construction-time buckets
    assert comm["bucket_bytes"] == ddp.get("rebuilt_bucket_sizes", ddp["bucket_sizes"])
    assert all(t > 0 for rank in comm["ms"] for step in rank for t in step)
    assert all(0 <= e <= b + 1e-9 for e, b in zip(comm["exposed_ms"][0], comm["busy_ms"][0], strict=True))
    metrics = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "comm/busy_ms" in metrics


def test_several_buckets_match_ddp_and_overlap(make_trainer, tmp_path):
    phases, comm, ddp, _ = profile(make_trainer, tmp_path, dim=256, num_layers=4, bucket_cap_mb=0.25)
    # Step 0 runs on DDP's construction-time layout, then DDP rebuilds its buckets: both must match DDP's own.
    assert comm["bucket_bytes_per_step"][0] == ddp["bucket_sizes"]
    assert comm["bucket_bytes"] == ddp["rebuilt_bucket_sizes"] == [4 * (256 * 256 + 256)] * 4
    assert all(sizes == comm["bucket_bytes"] for sizes in comm["bucket_bytes_per_step"][1:])
    assert sum(comm["bucket_bytes"]) == comm["param_bytes"] == 4 * 4 * (256 * 256 + 256)


def test_fp16_compression_halves_the_bytes_on_the_wire(make_trainer, tmp_path):
    _, half, _, _ = profile(make_trainer, tmp_path, dim=128, steps=2, compression="fp16")
    assert half["compression"] == "fp16"
    # Uncompressed, the bucket is the fp32 gradients (param_bytes; test_real_run_... checks that equality).
    assert half["param_bytes"] == 4 * (128 * 128 + 128)
    assert sum(half["bucket_bytes"]) * 2 == half["param_bytes"]


def test_comm_monitor_refuses_a_strategy_without_ddp():
    from lightning.pytorch import Trainer
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    trainer = Trainer(accelerator="cpu", devices=1, strategy="auto", logger=False, enable_checkpointing=False)
    assert "needs a DDP strategy, got SingleDeviceStrategy" in CommMonitor.unsupported(trainer)
    with pytest.raises(MisconfigurationException, match="needs a DDP strategy"):
        CommMonitor().setup(trainer, LinearRegression(dim=4), "fit")


@pytest.mark.slow
def test_profile_config_prints_the_notes_format_and_tables(tmp_path):
    result = run_fit("--config", str(ROOT / "configs" / "mini_train_profile.yaml"), "--devices", "2",
                     "--trainer.max_steps", "3", cwd=tmp_path, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for step in range(3):
        assert f"Step {step}\n forward : " in out
    assert "Phase times (perf_counter: host time), 2 rank(s), step 0 = warm-up, then 2 steady step(s):" in out
    assert "67,125,248 bytes reduced per step" in out
    assert "Roofline" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_profile_run_uses_cuda_events(tmp_path):
    from lightning.pytorch import Trainer

    from lit_ddp.strategy import LitDDPStrategy

    trainer = Trainer(accelerator="gpu", devices=1, strategy=LitDDPStrategy(), max_steps=4,
                      callbacks=[PhaseTimer(), CommMonitor()], logger=CSVLogger(tmp_path, name="gpu", version=0),
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(LinearRegression(dim=1024), FixedBatchDataModule(dim=1024))
    phases, comm = report.load(tmp_path / "gpu" / "version_0")
    assert phases["clock"] == "cuda_event" and comm["clock"] == "cuda_event"
    for forward, backward, update, _other, step in phases["ms"][0]:
        assert min(forward, backward, update, step) > 0
