"""CommMonitor on real 2-process runs: bytes exactly as DDP's buckets, times that make sense, compression."""

import re

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, PhaseTimer
from lit_ddp.records import schema as record
from tests.trainers import profile


def test_real_run_bytes_are_exact(make_trainer, tmp_path):
    _, comm, ddp, log_dir = profile(make_trainer, tmp_path, dim=1024)
    assert comm.layout == [4 * (1024 * 1024 + 1024)] == [4_198_400]
    assert comm.param_bytes == 4_198_400
    assert comm.first_layout == ddp["bucket_sizes"]  # DDP's construction-time buckets
    assert comm.layout == ddp.get("rebuilt_bucket_sizes", ddp["bucket_sizes"])
    assert comm.meta.world_size == 2 and [rank.rank for rank in comm.ranks] == [0, 1]
    for rank in comm.ranks:
        assert [row.step for row in rank.rows] == [0, 1, 2, 3]
        assert all(t > 0 for row in rank.rows for t in row.ms)
        assert all(0 <= row.exposed_ms <= row.busy_ms + 1e-9 for row in rank.rows)
        # Over the steady steps (1-3), one summary per figure.
        figures = ["busy_ms", "exposed_ms", "total_ms", "bucket0.ms", "bucket0.ready_ms"]
        assert {name: s.count for name, s in rank.summaries.items()} == dict.fromkeys(figures, 3)
    metrics = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "comm/busy_ms" in metrics


def test_several_buckets_match_ddp_and_overlap(make_trainer, tmp_path):
    phases, comm, ddp, _ = profile(make_trainer, tmp_path, dim=256, num_layers=4, bucket_cap_mb=0.25)
    # Step 0 runs on DDP's construction-time layout, then DDP rebuilds its buckets: both must match DDP's own.
    assert comm.first_layout == comm.ranks[0].rows[0].bytes == ddp["bucket_sizes"]
    assert comm.layout == ddp["rebuilt_bucket_sizes"] == [4 * (256 * 256 + 256)] * 4
    assert all(row.bytes == comm.layout for rank in comm.ranks for row in rank.rows[1:])
    assert sum(comm.layout) == comm.param_bytes == 4 * 4 * (256 * 256 + 256)
    assert all(f"bucket{b}.ready_ms" in rank.summaries for rank in comm.ranks for b in range(4))


def test_fp16_compression_halves_the_bytes_on_the_wire(make_trainer, tmp_path):
    _, half, _, _ = profile(make_trainer, tmp_path, dim=128, steps=2, compression="fp16")
    assert half.compression == "fp16"
    # Uncompressed, the bucket is the fp32 gradients (param_bytes; test_real_run_... checks that equality).
    assert half.param_bytes == 4 * (128 * 128 + 128)
    assert sum(half.layout) * 2 == half.param_bytes


@pytest.mark.parametrize("given", ["ddp_comm_hook", "ddp_comm_wrapper"])
def test_a_strategy_level_fp16_cast_is_timed_as_compression(make_trainer, tmp_path, given):
    """``ddp_comm_hook=fp16_compress_hook`` (or the wrapper): the record holds the fp16 bytes the all-reduce sent and
    names the cast, as ``CommMonitor(compression="fp16")`` does; timed from outside, it read fp32 bytes and none."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    cast = {"ddp_comm_hook": default_hooks.fp16_compress_hook, "ddp_comm_wrapper": default_hooks.fp16_compress_wrapper}
    _, comm, _, _ = profile(make_trainer, tmp_path, dim=128, steps=2, **{given: cast[given]})
    assert comm.compression == "fp16" and comm.wire_dtype == "float16"
    assert sum(comm.layout) * 2 == comm.param_bytes == 4 * (128 * 128 + 128)
    assert comm.ddp_memory.compression == "fp16"


def test_split_cast_takes_torch_casts_apart_and_refuses_two():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from lit_ddp.callbacks.comm_monitor import split_cast

    plain = default_hooks.allreduce_hook
    assert split_cast(None, None, None) == (plain, None, False)
    assert split_cast(None, None, "bf16") == (plain, "bf16", False)
    assert split_cast(default_hooks.bf16_compress_hook, None, None) == (plain, "bf16", False)
    assert split_cast(None, default_hooks.fp16_compress_wrapper, None) == (plain, "fp16", False)
    # A hook CommMonitor cannot see inside: timed from outside (opaque), a cast wrapper still outside it.
    assert split_cast(powerSGD_hook.powerSGD_hook, default_hooks.fp16_compress_wrapper, None) == (
        powerSGD_hook.powerSGD_hook, "fp16", True)  # fmt: skip
    with pytest.raises(ValueError, match=r"compression='bf16'.*fp16_compress_hook.*2 casts of the gradients"):
        split_cast(default_hooks.fp16_compress_hook, None, "bf16")


def test_comm_monitor_stands_aside_without_ddp():
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, strategy="auto", logger=False, enable_checkpointing=False)
    assert "needs a DDP strategy, got SingleDeviceStrategy" in CommMonitor.unsupported(trainer)
    monitor = CommMonitor()
    with pytest.warns(UserWarning, match="needs a DDP strategy, got SingleDeviceStrategy: it stands aside"):
        monitor.setup(trainer, LinearRegression(dim=4), "fit")
    # No hook to register, and no record; nor an EndOfFit expecting one.
    assert monitor.standing_aside and monitor.record is None
    monitor.on_train_start(trainer, trainer.lightning_module)
    assert not any(type(c).__name__ == "EndOfFit" for c in trainer.callbacks)


@pytest.mark.slow
def test_profile_config_prints_the_notes_format_and_tables(profile_run):
    result = profile_run.result  # the config as it is: 10 steps at dim 4096
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for step in range(3):
        assert f"Step {step}\n forward : " in out
    assert ("Phase times (perf_counter: host time), 2 rank(s), step 0 = warm-up, then 6 steady step(s) (steps 2-4 "
            "ran under the profiler for the memory columns, left out of the others):") in out  # fmt: skip
    assert re.search(r"^phase .* peak memory +retained$", out, re.M), out
    assert "Memory per rank (exact, from the live objects): parameters 67,125,248 bytes" in out
    assert "67,125,248 bytes reduced per step" in out
    assert "Roofline" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_profile_run_uses_cuda_events(tmp_path):
    from lightning.pytorch import Trainer

    from lit_ddp.run.strategy import LitDDPStrategy

    trainer = Trainer(accelerator="gpu", devices=1, strategy=LitDDPStrategy(), max_steps=4,
                      callbacks=[PhaseTimer(), CommMonitor()], logger=CSVLogger(tmp_path, name="gpu", version=0),
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(LinearRegression(dim=1024), FixedBatchDataModule(dim=1024))
    phases, comm = record.load_run(tmp_path / "gpu" / "version_0")
    assert phases.meta.clock == "cuda_event" and comm.meta.clock == "cuda_event"
    for row in phases.ranks[0].rows:
        assert min(row.ms.forward, row.ms.backward, row.ms.update, row.ms.step) > 0
    # Steps 2-4 ran under the profiler (kernel_steps defaults to 3 on CUDA): in the window, out of the summaries.
    assert phases.profiled_steps == comm.profiled_steps == [2, 3, 4]
    assert [row.step for row in phases.ranks[0].busy_ms] == [2, 3]  # max_steps=4: step 4 never ran
    assert phases.ranks[0].summaries["step"].count == comm.ranks[0].summaries["total_ms"].count == 1  # step 1
