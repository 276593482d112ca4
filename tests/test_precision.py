"""Mixed precision as users run it, on 2 CPU ranks: ``--trainer.precision bf16-mixed`` through the CLI, and
``16-mixed`` with its grad scaler in a Trainer of one's own (Lightning turns ``precision="16-mixed"`` on CPU into
bf16; its ``MixedPrecision("16-mixed", "cpu")`` plugin runs fp16 autocast and a CPU GradScaler). The tables name
the precision, the roofline takes the matching dtype's peak, the all-reduce table the dtype on the wire (fp32:
mixed precision keeps fp32 gradients), and a step the grad scaler skipped is counted and said. The same on a GPU
with ``precision="16-mixed"`` is ``skipif(no CUDA)``."""

import re

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, SyncCheck
from lit_ddp.callbacks.phase_timer import _compute_dtype
from lit_ddp.measure import roofline
from lit_ddp.measure.step_marks import Updates
from lit_ddp.present.phases import roofline_table
from lit_ddp.records import schema as record
from tests.recorders import RecordLogs
from tests.records import phase_record
from tests.runner import run_fit, step_losses
from tests.trainers import cpu_start_method

DIM = 32


@pytest.mark.timeout(150)
def test_bf16_mixed_through_the_cli(tmp_path):
    result = run_fit("--devices", "2", "--model.dim", str(DIM), "--data.batch_size", "8", "--trainer.max_steps", "4",
                     "--trainer.precision", "bf16-mixed", "--trainer.callbacks+=lit_ddp.callbacks.PhaseTimer",
                     "--trainer.callbacks+=lit_ddp.callbacks.CommMonitor", cwd=tmp_path, timeout=140)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Phase times (perf_counter: host time), 2 rank(s), precision bf16-mixed, step 0 = warm-up" in out, out
    assert "Roofline (rank 0, steady median; bf16-mixed: matmuls in bfloat16):" in out
    assert "Gradient all-reduce per step (2 ranks, float32 on the wire, compression none, all ranks" in out
    assert ("bf16-mixed runs the matmuls in 16 bits but keeps the parameters and their gradients in float32: the "
            "all-reduce moves float32") in out  # fmt: skip
    phases, comm = record.load_run(tmp_path / "runs" / "mini_train" / "version_0")
    assert phases.meta.precision == "bf16-mixed" and phases.roofline.compute_dtype == "bfloat16"
    assert comm.wire_dtype == "float32" and sum(comm.layout) == (DIM * DIM + DIM) * 4  # 4 bytes per gradient
    assert phases.skipped_count == 0 and "skipped" not in out


class InfGradient(Callback):
    """After step 2's backward (the all-reduce is done: every rank holds the same inf), as an fp16 overflow would."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 2:
            next(pl_module.parameters()).grad.view(-1)[0] = float("inf")


def run_16_mixed(tmp_path, accelerator, fused=False):
    """A user's Trainer at 16-mixed, Lightning's own DDP strategy: 2 CPU ranks forked from this process (with
    Lightning's fp16 plugin), or 1 GPU; what rank 0 printed. ``fused``: Adam's fused kernel, which takes the grad
    scaler's ``found_inf`` itself (the scaler then always calls ``optimizer.step()``)."""
    seed_everything(0)
    cpu = accelerator == "cpu"
    plugins = [MixedPrecision("16-mixed", "cpu")] if cpu else []
    trainer = Trainer(accelerator=accelerator, devices=2 if cpu else 1, max_steps=5,
                      strategy=DDPStrategy(start_method=cpu_start_method()) if cpu else "ddp", plugins=plugins,
                      precision=None if plugins else "16-mixed", logger=CSVLogger(tmp_path / "out", name="run",
                      version=0), enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[PhaseTimer(), CommMonitor(compression="fp16"), SyncCheck(),
                                 LossMonitor(every_n_steps=1), InfGradient(), RecordLogs(tmp_path)])  # fmt: skip
    trainer.fit(LinearRegression(dim=32, fused=fused), FixedBatchDataModule(dim=32, batch_size=8))
    return RecordLogs.read(tmp_path, 0)


def check_16_mixed(out, tmp_path):
    assert re.search(r"^Step 2, Loss [0-9.]+ \(update skipped: the grad scaler found inf/NaN gradients\)$", out, re.M)
    losses = step_losses("\n".join(line.split(" (update")[0] for line in out.splitlines()))
    assert len(losses) == 5 and losses[3] == losses[2]  # no update at step 2: step 3 starts from the same weights
    assert ("1 optimizer step(s) skipped by the 16-mixed grad scaler (inf/NaN gradients, no update; the scale was "
            "lowered): step(s) 2; left out of the medians") in out  # fmt: skip
    assert "precision 16-mixed, step 0 = warm-up, then 3 steady step(s)" in out  # steps 1, 3, 4
    assert "Roofline (rank 0, steady median; 16-mixed: matmuls in float16" in out
    assert re.search(r"^Gradient all-reduce per step \([12] ranks, float16 on the wire, compression fp16", out, re.M)
    phases, comm = record.load_run(tmp_path / "out" / "run" / "version_0")
    assert (phases.skipped_count, phases.skipped_steps) == (1, [2])
    assert [row.step for row in phases.steady_rows()] == [1, 3, 4]
    assert phases.roofline.compute_dtype == "float16" and comm.wire_dtype == "float16"


def test_16_mixed_grad_scaler_skip_in_a_users_script_on_cpu(tmp_path):
    out = run_16_mixed(tmp_path, "cpu")
    check_16_mixed(out, tmp_path)


def test_16_mixed_grad_scaler_skip_with_a_fused_optimizer_on_cpu(tmp_path):
    """torch's CPU GradScaler and fused Adam: the scaler calls ``optimizer.step()`` at step 2 too (the kernel skips
    the update), and the skip is still seen, through ``found_inf``."""
    out = run_16_mixed(tmp_path, "cpu", fused=True)
    check_16_mixed(out, tmp_path)


class FakeScaler:
    """``torch.amp.GradScaler.step``'s two ways with an optimizer, on any device: an optimizer that takes the
    scaling in its own kernel (``_step_supports_amp_scaling``: ``fused=True``) is always stepped, with ``found_inf``
    set for that call; any other is not stepped when a gradient is inf/NaN."""

    def __init__(self, inf: bool) -> None:
        self.inf = inf

    def step(self, optimizer):
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale, optimizer.found_inf = None, torch.tensor(float(self.inf))
            try:
                return optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        if not self.inf:
            return optimizer.step()


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_update_is_seen_whether_or_not_the_scaler_calls_step(fused):
    layer = torch.nn.Linear(4, 4)
    first, second = (torch.optim.Adam([p], fused=fused) for p in (layer.weight, layer.bias))
    updates = Updates()
    for opt in (first, second):  # every optimizer, as PhaseTimer and LossMonitor hook them
        opt.register_step_post_hook(lambda optimizer, args, kwargs: updates.ran(optimizer))
    for inf_first, inf_second in ((False, False), (False, True), (True, False), (True, True)):
        layer(torch.randn(2, 4)).sum().backward()
        before = [p.detach().clone() for p in (layer.weight, layer.bias)]
        for opt, inf in ((first, inf_first), (second, inf_second)):  # manual optimization, two optimizers
            updates.begin()
            FakeScaler(inf).step(opt)
        skipped = updates.skipped()
        assert isinstance(skipped, torch.Tensor) == fused  # a fused optimizer's flag stays a tensor: no read
        assert bool(skipped) == (inf_first or inf_second), (inf_first, inf_second)
        # The control: the fake scaler did skip (or not) the updates it was told to.
        after = (layer.weight, layer.bias)
        assert [torch.equal(b, a) for b, a in zip(before, after, strict=True)] == [inf_first, inf_second]
    assert updates.skipped() is False  # reset after each step: nothing begun, nothing skipped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(150)
def test_16_mixed_on_a_gpu(tmp_path):
    out = run_16_mixed(tmp_path, "gpu")
    check_16_mixed(out, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(150)
def test_16_mixed_with_a_fused_optimizer_on_a_gpu(tmp_path):
    """The fused path on CUDA: ``found_inf`` on the device, read only once the step's work is done."""
    out = run_16_mixed(tmp_path, "gpu", fused=True)
    check_16_mixed(out, tmp_path)


def test_the_roofline_takes_the_precisions_peak():
    model = torch.nn.Linear(2, 2)
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16), ("32-true", torch.float32)):
        assert _compute_dtype(type("T", (), {"precision": precision})(), model) == dtype
    assert roofline.peak_for("NVIDIA H200", torch.bfloat16).label == "H200 SXM, bf16 dense"
    roof = record.Roofline(rows_per_rank=8, forward_flop=1e12, backward_flop=2e12, update_bytes=1e9,
                           peak_tflops=989.5, peak_gbps=4800.0, peak_label="H200 SXM, bf16 dense",
                           compute_dtype="bfloat16")  # fmt: skip
    phases = phase_record([[(0, 0, 0, 0), (2.0, 4.0, 1.0, 0.0)]], roofline=roof)
    phases.meta.precision = "bf16-mixed"
    table = roofline_table(phases)
    assert table.startswith("Roofline (rank 0, steady median; bf16-mixed: matmuls in bfloat16; peak H200 SXM, "
                            "bf16 dense):")  # fmt: skip
    assert re.search(r"^forward\s+1.00 TFLOP\s+2.00 ms\s+500.0 TFLOP/s\s+50.5%$", table, re.M), table
