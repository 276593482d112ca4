"""Roofline inputs: step FLOPs against FlopCounterMode by hand, optimizer bytes from real state, GPU peaks,
and a real 2-process DDP fit in which the user's ``training_step`` runs exactly as often as Lightning calls it."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, SyncCheck
from lit_ddp.lab.data import FixedBatchDataModule
from lit_ddp.lab.module import LinearRegression
from lit_ddp.measure.roofline import GPU_PEAKS, StepFlopCounter, StepFlops, optimizer_update_bytes, peak_for
from lit_ddp.records.schema import load
from tests.trainers import fast_trainer

pytestmark = pytest.mark.timeout(60)


def transformer_batch() -> tuple[Tensor, Tensor]:
    """8 sequences of 16 token ids, inputs and targets, as LightningTransformer.training_step unpacks them."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 1000, (8, 16), generator=gen), torch.randint(0, 1000, (8, 16), generator=gen)


def counted_step(model: LightningModule, batch, optimizer=None) -> StepFlops:
    """One real step under ``StepFlopCounter``, its hooks called where PhaseTimer's hooks call them."""
    counter = StepFlopCounter()
    counter.start()
    loss = model.training_step(batch, 0)
    counter.backward_start()
    loss.backward()
    counter.backward_end()
    if optimizer is not None:
        counter.update_start()
        optimizer.step()
        counter.update_end()
    return counter.stop()


def test_transformer_flops_match_flop_counter_by_hand():
    torch.manual_seed(0)
    model = LightningTransformer(vocab_size=1000)
    batch = transformer_batch()
    flops = counted_step(copy.deepcopy(model), batch)

    with FlopCounterMode(display=False) as counter:
        loss = model.training_step(batch, 0)
        forward = counter.get_total_flops()
        loss.backward()
        backward = counter.get_total_flops() - forward
    assert forward > 0.3e9  # 0.389 GFLOP: attention and all projections, not only the nn.Linear layers
    assert (flops.forward, flops.backward) == (forward, backward)
    # Every matmul of the forward has two in the backward of the same size, one per input that needs a
    # gradient; here the embeddings are trainable, so every matmul input does and the ratio is 2. Inputs
    # that need none (raw data, frozen weights) take it below 2, towards 1; nothing takes it above 2.
    assert 1.5 <= flops.backward / flops.forward <= 2.05


def test_linear_regression_exact_counts():
    model = LinearRegression(dim=16, num_layers=3)
    batch = (torch.randn(4, 16), torch.randn(4, 16))
    # FlopCounterMode counts nn.Linear's addmm as its matmul alone, 2 * rows * in * out (the bias add and the
    # loss are elementwise and not counted): 3 layers x 2 * 4 * 16 * 16 = 6144. Backward: the weight gradient
    # dy^T @ x of every layer (3 x 2048) and the input gradient dy @ W of layers 2 and 3 (2 x 2048); the
    # first layer's input is data, so autograd skips its input gradient. Bias gradients are sums: not counted.
    assert counted_step(model, batch) == StepFlops(forward=6144, backward=10240)
    # A frozen weight needs no gradient: the first layer's dW drops out (its bias still trains).
    model.net[0].weight.requires_grad_(False)
    assert counted_step(model, batch) == StepFlops(forward=6144, backward=8192)


class MatmulSGD(torch.optim.SGD):
    """An optimizer whose step runs a matmul (as Shampoo's or Muon's do): 2 * 16^3 FLOPs per call."""

    def step(self, closure=None):
        torch.ones(16, 16) @ torch.ones(16, 16)
        return super().step(closure)


def test_an_optimizers_matmul_is_no_forward_and_a_count_ends_once():
    model = LinearRegression(dim=16, num_layers=3)
    batch = (torch.randn(4, 16), torch.randn(4, 16))
    assert counted_step(model, batch, MatmulSGD(model.parameters(), lr=0.1)) == StepFlops(6144, 10240)
    counter = StepFlopCounter()
    assert counter.stop() is None and not counter.active  # never started: nothing, and no counter left open
    counter.start()
    assert counter.active
    counter.stop()
    assert not counter.active and counter.stop() is None


OPTIMIZERS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), 12),
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 20),
    "adam": (lambda ps: torch.optim.Adam(ps), 28),
    "adam_per_param": (lambda ps: torch.optim.Adam(ps, foreach=False), 28),
    "adam_foreach": (lambda ps: torch.optim.Adam(ps, foreach=True), 28),
    "adam_fused": (lambda ps: torch.optim.Adam(ps, fused=True), 28),
    "adamw": (lambda ps: torch.optim.AdamW(ps), 28),
    "adam_amsgrad": (lambda ps: torch.optim.Adam(ps, amsgrad=True), 36),
}


def linear_with_an_unused_parameter(dtype: torch.dtype = torch.float32) -> tuple[nn.Linear, nn.Parameter]:
    """A 10 x 10 Linear (110 parameters) with grads, and a 7-element parameter the loss does not use."""
    torch.manual_seed(0)
    layer = nn.Linear(10, 10).to(dtype)
    layer(torch.randn(3, 10, dtype=dtype)).sum().backward()
    return layer, nn.Parameter(torch.zeros(7, dtype=dtype))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_update_bytes_after_one_step(name):
    make, bytes_per_param = OPTIMIZERS[name]
    layer, unused = linear_with_an_unused_parameter()
    optimizer = make([*layer.parameters(), unused])
    optimizer.step()
    assert unused.grad is None  # no grad: the step skips it, and so does the count
    assert optimizer_update_bytes(optimizer) == bytes_per_param * 110


@pytest.mark.parametrize("name, bytes_per_param", [("sgd", 12), ("sgd_momentum", 12), ("adam", 12)])
def test_update_bytes_before_any_step_sees_no_state(name, bytes_per_param):
    layer, _ = linear_with_an_unused_parameter()
    optimizer = OPTIMIZERS[name][0](layer.parameters())
    assert optimizer_update_bytes(optimizer) == bytes_per_param * 110  # state is created by the first step


def test_update_bytes_use_each_tensors_element_size():
    layer, _ = linear_with_an_unused_parameter(torch.bfloat16)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    assert optimizer_update_bytes(optimizer) == 5 * 2 * 110  # bf16 param, grad and momentum: 2 bytes each


def test_update_bytes_use_each_state_tensors_own_element_size():
    layer, _ = linear_with_an_unused_parameter()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    for p in layer.parameters():  # float32 params and grads, a bfloat16 momentum
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.bfloat16)
    assert optimizer_update_bytes(optimizer) == (2 * 4 + 4 + 2 * 2) * 110


DEVICES = [  # name as torch.cuda.get_device_name() reports it, label, bf16, tf32, fp32 TFLOP/s, GB/s
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5, 494.5, 67.0, 3350.0),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0, 51.0, 2000.0),
    ("NVIDIA H200", "H200 SXM", 989.5, 494.5, 67.0, 4800.0),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 312.0, 156.0, 19.5, 2039.0),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", 312.0, 156.0, 19.5, 1935.0),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0, 156.0, 19.5, 1555.0),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB", 312.0, 156.0, 19.5, 1555.0),
    ("NVIDIA L4", "L4", 121.0, 60.0, 30.3, 300.0),
]


@pytest.fixture
def matmul_precision():
    """Lets a test change torch's global float32 matmul precision and puts it back afterwards."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("name, label, bf16, tf32, fp32, gbps", DEVICES)
def test_peak_for_known_devices(name, label, bf16, tf32, fp32, gbps, matmul_precision):
    peak = peak_for(name, torch.bfloat16)
    assert (peak.tflops, peak.gbps, peak.label) == (bf16, gbps, f"{label}, bf16 dense")
    assert "datasheet" in peak.source
    assert peak_for(name, torch.float16).label == f"{label}, fp16 dense"
    assert peak_for(name, torch.float16).tflops == bf16
    matmul_precision("high")  # float32 matmuls may use TF32 tensor cores
    assert (peak_for(name, torch.float32).tflops, peak_for(name, torch.float32).label) == (tf32, f"{label}, tf32 dense")
    matmul_precision("highest")
    assert (peak_for(name, torch.float32).tflops, peak_for(name, torch.float32).label) == (fp32, f"{label}, fp32")
    assert peak_for(name, torch.float64) is None
    assert peak_for(f" {name.lower()} ", torch.bfloat16) == peak


def test_allow_tf32_switch_also_selects_tf32(matmul_precision):
    matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = True  # torch couples the two switches: the fixture resets both
    assert peak_for("NVIDIA H200", torch.float32).label == "H200 SXM, tf32 dense"


@pytest.mark.parametrize(
    "name",
    ["cpu", "", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA GeForce RTX 4090"],
)
def test_peak_for_unknown_devices_is_none(name):
    assert peak_for(name, torch.bfloat16) is None


def test_every_row_is_dense_and_sourced():
    for row in GPU_PEAKS:
        # On all these GPUs dense TF32 is half of dense bf16; a sparsity figure copied by mistake breaks that.
        assert row.bf16_tflops / row.tf32_tflops == pytest.approx(2.0, rel=0.02), row.label
        assert row.fp32_tflops < row.tf32_tflops, row.label
        assert "datasheet" in row.source, row.label


class CountedCalls(LinearRegression):
    """LinearRegression that counts its own ``training_step`` calls, in a plain attribute and in a torchmetrics
    metric: what a user's counters and metrics would see of a tool that ran the step once more."""

    def __init__(self, dim: int = 16, num_layers: int = 3) -> None:
        super().__init__(dim=dim, num_layers=num_layers, lr=1e-2)
        self.calls = 0
        self.metric_calls = torchmetrics.SumMetric()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.calls += 1
        self.metric_calls.update(1.0)
        return super().training_step(batch, batch_idx)


class WriteCalls(Callback):
    """Each rank writes, at the end of training, how often its ``training_step`` ran and Lightning's step count."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        local = pl_module.metric_calls.metric_state["sum_value"].item()  # this rank's, before any sync
        calls = {"calls": pl_module.calls, "metric": local, "global_step": trainer.global_step}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(calls))


def test_the_users_step_runs_as_often_as_lightning_calls_it_on_real_ranks(tmp_path):
    """Every callback of the tool on 2 real ranks: PhaseTimer counts the FLOPs of the step Lightning runs (its
    first), and the user's counter and torchmetrics metric both see max_steps calls, no more."""
    steps = 4
    callbacks = [PhaseTimer(), CommMonitor(), LossMonitor(every_n_steps=0), SyncCheck(), WriteCalls(tmp_path)]
    trainer = fast_trainer(tmp_path, max_steps=steps, callbacks=callbacks,
                           logger=CSVLogger(tmp_path, name="run", version=0))  # fmt: skip
    trainer.fit(CountedCalls(), FixedBatchDataModule(dim=16, batch_size=8))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"calls": steps, "metric": float(steps), "global_step": steps}, rank
    phases = load(tmp_path / "run" / "version_0" / "phases.json")
    # One rank's step: its 8 rows (2 x 8 x 16 x 16 per layer, 3 layers; backward: 3 dW and 2 dX), counted as it ran.
    roof = phases.roofline
    assert (roof.forward_flop, roof.backward_flop, roof.rows_per_rank) == (12288, 20480, 8)
    assert roof.flop_source == "FlopCounterMode, step 0"
