"""Roofline inputs: step FLOPs against FlopCounterMode by hand, optimizer bytes from real state, GPU peaks,
and a real 2-process DDP fit that must train bit for bit as if the FLOPs had not been counted."""

import copy
import json
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from lit_ddp.lab.data import FixedBatchDataModule
from lit_ddp.lab.module import LinearRegression
from lit_ddp.measure.roofline import GPU_PEAKS, StepFlops, count_step_flops, optimizer_update_bytes, peak_for
from tests.trainers import cpu_start_method

pytestmark = pytest.mark.timeout(60)


class NoisyRegression(LinearRegression):
    """LinearRegression whose step also updates buffers (BatchNorm) and draws random numbers (dropout)."""

    def __init__(self, dim: int = 16, num_layers: int = 3) -> None:
        super().__init__(dim=dim, num_layers=num_layers, lr=1e-2)
        self.norm = nn.BatchNorm1d(dim)
        self.dropout = nn.Dropout(0.5)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return ((self(self.dropout(self.norm(x))) - y) ** 2).mean()


class Counting(LightningModule):
    """A step that replaces a buffer instead of updating it in place, and returns what it is told to."""

    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        self.output = output
        self.layer = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def training_step(self, batch: Tensor, batch_idx: int):
        self.calls = self.calls + 1
        out = self.layer(batch)
        loss = out.sum()
        outputs = {"tensor": loss, "dict": {"loss": loss, "extra": 1}, "none": None, "list": [loss]}
        return out.sum(0) if self.output == "vector" else outputs[self.output]


def transformer_batch() -> tuple[Tensor, Tensor]:
    """8 sequences of 16 token ids, inputs and targets, as LightningTransformer.training_step unpacks them."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 1000, (8, 16), generator=gen), torch.randint(0, 1000, (8, 16), generator=gen)


def test_transformer_flops_match_flop_counter_by_hand():
    torch.manual_seed(0)
    model = LightningTransformer(vocab_size=1000)
    batch = transformer_batch()
    flops = count_step_flops(model, batch)

    with FlopCounterMode(display=False) as counter:
        loss = model.training_step(batch, 0)
        forward = counter.get_total_flops()
        loss.backward()
        backward = counter.get_total_flops() - forward
    assert forward > 0.3e9  # 0.389 GFLOP: attention and all projections, not only the nn.Linear layers
    assert flops.forward == pytest.approx(forward, rel=0.1)
    assert flops.backward == pytest.approx(backward, rel=0.1)
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
    assert count_step_flops(model, batch) == StepFlops(forward=6144, backward=10240)
    # A frozen weight needs no gradient: the first layer's dW drops out (its bias still trains).
    model.net[0].weight.requires_grad_(False)
    assert count_step_flops(model, batch) == StepFlops(forward=6144, backward=8192)


def test_parameters_grads_buffers_and_rng_are_left_as_they_were():
    torch.manual_seed(0)
    model = NoisyRegression(dim=8, num_layers=2)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    for p in model.net.parameters():  # some grads set, the norm's left None
        p.grad = torch.randn_like(p)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    rng = torch.get_rng_state()

    flops = count_step_flops(model, batch)
    next_draw = torch.rand(8)

    assert flops is not None and flops.forward > 0
    torch.set_rng_state(rng)
    assert torch.equal(next_draw, torch.rand(8)), "count_step_flops advanced the CPU RNG"
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), f"{key} changed"
    for name, b in model.named_buffers():
        assert b is buffers[name], f"buffer {name} was replaced"
    for name, p in model.named_parameters():
        if grads[name] is None:
            assert p.grad is None, f"{name}.grad was set"
        else:
            assert torch.equal(p.grad, grads[name]), f"{name}.grad changed"

    # The control: the same step run plainly does all of that, so the checks above can see it.
    torch.set_rng_state(rng)
    model.training_step(batch, 0).backward()
    assert not torch.equal(torch.rand(8), next_draw)
    assert not torch.equal(model.norm.running_mean, state["norm.running_mean"])
    assert model.norm.weight.grad is not None


def test_a_replaced_buffer_is_put_back():
    model = Counting()
    calls = model.calls
    count_step_flops(model, torch.randn(2, 4))
    assert model.calls is calls and model.calls.item() == 0
    model.training_step(torch.randn(2, 4), 0)
    assert model.calls.item() == 1  # the control: the step does replace it


@pytest.mark.parametrize("train", [True, False])
def test_counting_between_a_forward_and_its_backward_leaves_that_backward_as_it_was(train):
    # Where a callback's on_before_backward runs. BatchNorm's graph saved its running statistics: putting their
    # values back must not look like an in-place change to it ("modified by an inplace operation").
    torch.manual_seed(0)
    model = NoisyRegression(dim=8, num_layers=2).train(train)
    reference = copy.deepcopy(model)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    rng = torch.get_rng_state()
    model.training_step(batch, 0).backward()  # the control: no count in between
    torch.set_rng_state(rng)
    loss = reference.training_step(batch, 0)
    count_step_flops(reference, batch)
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), f"{name}.grad differs"


def test_what_training_step_returns():
    batch = torch.randn(2, 4)
    tensor_flops = count_step_flops(Counting("tensor"), batch)
    assert tensor_flops == StepFlops(forward=2 * 2 * 4 * 4, backward=2 * 2 * 4 * 4)  # dW only: x is data
    assert count_step_flops(Counting("dict"), batch) == tensor_flops
    assert count_step_flops(Counting("none"), batch) is None  # Lightning skips the batch: nothing to count
    with pytest.raises(TypeError, match=r"got list: \[tensor"):
        count_step_flops(Counting("list"), batch)
    with pytest.raises(ValueError, match=r"must be a scalar, got shape \(4,\)"):
        count_step_flops(Counting("vector"), batch)
    frozen = Counting()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="Counting has no parameter that requires grad"):
        count_step_flops(frozen, batch)


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


class CountInsideFit(Callback):
    """Counts the step's FLOPs from inside a fit, in two places, and writes what it got per rank.

    On the first batch from ``on_train_batch_start``, before the step; on the second from
    ``on_before_backward``, between DDP's forward and the backward that all-reduces the gradients.

    Args:
        out_dir: Where each rank writes ``rank<r>_<hook>.json``.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._batch = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self._batch = batch if batch_idx == 1 else None
        if batch_idx == 0:
            self._write(trainer, "batch_start", count_step_flops(pl_module, batch, batch_idx))

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        if self._batch is not None:
            self._write(trainer, "before_backward", count_step_flops(pl_module, self._batch, 1))

    def _write(self, trainer: Trainer, hook: str, flops: StepFlops) -> None:
        record = {**asdict(flops), "ddp": isinstance(trainer.model, DistributedDataParallel)}
        (self.out_dir / f"rank{trainer.global_rank}_{hook}.json").write_text(json.dumps(record))


def fit_noisy(tmp_path: Path, callbacks: list[Callback]) -> dict[str, Tensor]:
    """A 3-step, 2-rank CPU ``ddp_fork`` fit of NoisyRegression; returns rank 0's final state dict."""
    seed_everything(0)
    model = NoisyRegression(dim=16, num_layers=3)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(start_method=cpu_start_method(), timeout=timedelta(seconds=30)),
        max_steps=3,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, FixedBatchDataModule(dim=16, batch_size=4))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_counting_inside_a_ddp_fit_does_not_change_training(tmp_path):
    plain = fit_noisy(tmp_path, [])
    counted = fit_noisy(tmp_path, [CountInsideFit(tmp_path)])

    for rank in (0, 1):
        for hook in ("batch_start", "before_backward"):
            record = json.loads((tmp_path / f"rank{rank}_{hook}.json").read_text())
            # The BatchNorm's weight is trainable, so every layer's input needs a gradient: 3 dW + 3 dX.
            assert record == {"forward": 6144, "backward": 12288, "ddp": True}, (rank, hook)
    assert plain.keys() == counted.keys()
    seed_everything(0)
    initial = NoisyRegression(dim=16, num_layers=3).state_dict()
    assert not torch.equal(plain["net.0.weight"], initial["net.0.weight"])  # it did train
    for key in plain:  # weights, BatchNorm statistics and step counter: bit for bit
        assert torch.equal(plain[key], counted[key]), f"{key} differs"
