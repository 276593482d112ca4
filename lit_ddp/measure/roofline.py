"""Roofline inputs for any LightningModule and optimizer: step FLOPs, update bytes, and GPU peaks.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2    # PhaseTimer prints its table

``StepFlopCounter`` counts a real training step under torch's ``FlopCounterMode`` as Lightning runs it (the
user's code runs no extra time), so every op the step dispatches is counted;
``optimizer_update_bytes`` reads the optimizer's real state, so each optimizer moves what it actually keeps;
``GPU_PEAKS`` / ``peak_for`` give the datasheet peak of the device torch reports, for the step's dtype. What the
roofline table shows: docs/output.md.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from lit_ddp.records import phases


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step, as ``FlopCounterMode`` counts them (matmuls, convolutions, attention).

    Attributes:
        forward: FLOPs of ``training_step``, loss included.
        backward: FLOPs of the step's backward passes.
    """

    forward: int
    backward: int


class StepFlopCounter:
    """Counts the FLOPs of one real training step while Lightning runs it: torch's ``FlopCounterMode`` entered at the
    step's start and left at its end. The user's ``training_step`` runs once, as Lightning calls it: no probe of the
    tool's own calls it again, which a counter, a metric, a logged value or a schedule in the step would see.

    ``start`` before the step's first forward, ``backward_start`` / ``backward_end`` around each backward (what is
    counted between them is backward), ``update_start`` / ``update_end`` around each optimizer step (left out: torch's
    optimizers' elementwise ops are not in the counter's table of matmuls, convolutions and attention, and a matmul in
    an optimizer's step is no forward), ``stop`` when the step is done; the rest is forward, loss included. Under
    automatic and manual optimization alike, every micro-batch of the step. The count's own cost falls in the step it
    counts: PhaseTimer counts the fit's first, its warm-up, never a timed steady step.
    """

    def __init__(self) -> None:
        self._counter: Optional[FlopCounterMode] = None
        self._spans = {phases.BACKWARD: 0, phases.UPDATE: 0}
        self._since: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return self._counter is not None

    def start(self) -> None:
        # display=False: the counter would otherwise print a per-module table on exit, from every rank.
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def _open(self, span: str) -> None:
        if self._counter is not None:
            self._since[span] = self._counter.get_total_flops()

    def _close(self, span: str) -> None:
        since = self._since.pop(span, None)
        if self._counter is not None and since is not None:
            self._spans[span] += self._counter.get_total_flops() - since

    def backward_start(self) -> None:
        self._open(phases.BACKWARD)

    def backward_end(self) -> None:
        self._close(phases.BACKWARD)

    def update_start(self) -> None:
        self._open(phases.UPDATE)

    def update_end(self) -> None:
        self._close(phases.UPDATE)

    def stop(self) -> Optional[StepFlops]:
        """The step's FLOPs (None if it was not started); the count ends, also when the step failed."""
        counter = self._counter
        if counter is None:
            return None
        self._close(phases.UPDATE)  # an update without a step post-hook (or skipped by the grad scaler) ends here
        self._counter = None
        counter.__exit__(None, None, None)
        forward = counter.get_total_flops() - sum(self._spans.values())
        return StepFlops(forward=forward, backward=self._spans[phases.BACKWARD])


def optimizer_update_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of memory one ``optimizer.step()`` reads and writes, from the optimizer's current state.

    The model is a lower bound that counts every tensor once, as an ideal fused kernel would: for each
    parameter with a gradient, the update reads the parameter, its gradient and each of its ``k`` state
    tensors, and writes the parameter and the ``k`` state tensors: ``(3 + 2k) x`` the parameter's size,
    each tensor at its own element size. A state tensor counts when it has as many elements as the
    parameter (momentum, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``); scalars such as Adam's ``step``
    do not (for a one-element parameter they do, a few bytes too many). Re-reads of a multi-kernel
    (``foreach=False``) update are not counted, so foreach, fused and per-parameter implementations give
    the same figure: float32 SGD 12 bytes per parameter, SGD with momentum 20, Adam and AdamW 28, AMSGrad 36.

    Call it after at least one step: state is created lazily on the first ``step()``, so before it a
    stateful optimizer counts as stateless (Adam 12 bytes per parameter instead of 28).

    Args:
        optimizer: A torch optimizer (or Lightning's ``LightningOptimizer`` wrapper of one).

    Returns:
        The bytes moved by one step over every parameter that has a ``.grad``.
    """
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:  # torch's optimizers skip it, so it moves nothing
                continue
            param_bytes = param.numel() * param.element_size()
            grad_bytes = param.grad.numel() * param.grad.element_size()
            state = optimizer.state.get(param, {})
            state_bytes = sum(
                value.numel() * value.element_size()
                for value in state.values()
                if isinstance(value, Tensor) and value.numel() == param.numel()
            )
            total += 2 * param_bytes + grad_bytes + 2 * state_bytes
    return total


@dataclass(frozen=True)
class Peak:
    """The peak a step's time can be compared with on one device, for one dtype.

    Attributes:
        tflops: Peak dense math throughput, in TFLOP/s (1e12 FLOP/s).
        gbps: Peak memory bandwidth, in GB/s (1e9 bytes/s).
        label: Device and math mode, e.g. ``"H200 SXM, bf16 dense"``.
        source: The vendor document the figures come from.
    """

    tflops: float
    gbps: float
    label: str
    source: str


@dataclass(frozen=True)
class GpuPeaks:
    """Datasheet peaks of one GPU model. Tensor-core figures are dense: half the "with sparsity" figure.

    Attributes:
        label: The model as the datasheet names it, e.g. ``"H100 SXM"``.
        device_names: The names ``torch.cuda.get_device_name()`` reports for it, matched exactly
            (case-insensitive), so a MIG slice or an unlisted variant gets no peak instead of a wrong one.
        bf16_tflops: bf16 and fp16 tensor-core TFLOP/s, dense.
        tf32_tflops: TF32 tensor-core TFLOP/s, dense.
        fp32_tflops: fp32 TFLOP/s without tensor cores.
        gbps: Memory bandwidth, GB/s.
        source: The datasheet, and the column of it.
    """

    label: str
    device_names: tuple[str, ...]
    bf16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    gbps: float
    source: str


_HALF = "dense = half the datasheet's 'with sparsity' tensor-core figure"

GPU_PEAKS: tuple[GpuPeaks, ...] = (
    GpuPeaks("H100 SXM", ("NVIDIA H100 80GB HBM3",), 989.5, 494.5, 67.0, 3350.0,
             f"NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column; {_HALF}"),
    GpuPeaks("H100 PCIe", ("NVIDIA H100 PCIe",), 756.5, 378.0, 51.0, 2000.0,
             f"NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column; {_HALF}"),
    GpuPeaks("H200 SXM", ("NVIDIA H200",), 989.5, 494.5, 67.0, 4800.0,
             f"NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column; {_HALF}"),
    GpuPeaks("A100 SXM 80GB", ("NVIDIA A100-SXM4-80GB",), 312.0, 156.0, 19.5, 2039.0,
             "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (dense figures as printed)"),
    GpuPeaks("A100 PCIe 80GB", ("NVIDIA A100 80GB PCIe",), 312.0, 156.0, 19.5, 1935.0,
             "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB PCIe column (dense figures as printed)"),
    GpuPeaks("A100 40GB", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), 312.0, 156.0, 19.5, 1555.0,
             "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB PCIe and SXM columns (dense figures as printed)"),
    GpuPeaks("L4", ("NVIDIA L4",), 121.0, 60.0, 30.3, 300.0,
             f"NVIDIA L4 Tensor Core GPU datasheet; {_HALF}"),
)  # fmt: skip


def peak_for(device_name: str, dtype: torch.dtype) -> Optional[Peak]:
    """The datasheet peak of ``device_name`` for math in ``dtype``, or ``None`` when the table has none.

    bfloat16 and float16 get the tensor-core peak. float32 gets the TF32 tensor-core peak when torch may use
    TF32 for matmuls (``torch.get_float32_matmul_precision() != "highest"`` or
    ``torch.backends.cuda.matmul.allow_tf32``), read when called, and the plain fp32 peak otherwise.

    Args:
        device_name: The name as ``torch.cuda.get_device_name()`` reports it, e.g. ``"NVIDIA H200"``.
        dtype: The dtype the step's matmuls run in (under autocast, the autocast dtype).

    Returns:
        The peak, or ``None`` for a device not in ``GPU_PEAKS`` (CPUs, MIG slices, other GPUs) and for
        dtypes other than bfloat16, float16 and float32.
    """
    wanted = device_name.strip().casefold()
    row = next((r for r in GPU_PEAKS if wanted in (n.casefold() for n in r.device_names)), None)
    if row is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        tflops, mode = row.bf16_tflops, "bf16 dense" if dtype == torch.bfloat16 else "fp16 dense"
    elif dtype == torch.float32 and _tf32_matmuls():
        tflops, mode = row.tf32_tflops, "tf32 dense"
    elif dtype == torch.float32:
        tflops, mode = row.fp32_tflops, "fp32"
    else:
        return None
    return Peak(tflops=tflops, gbps=row.gbps, label=f"{row.label}, {mode}", source=row.source)


def _tf32_matmuls() -> bool:
    """Whether torch may run float32 matmuls on TF32 tensor cores.

    torch (2.13 checked) keeps ``allow_tf32`` and the matmul precision in step, so either test answers; both are
    read so that a build that lets them disagree is still read as TF32 when either allows it.
    """
    return torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
