"""Roofline inputs for any LightningModule and optimizer: step FLOPs, update bytes, and GPU peaks.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2    # PhaseTimer prints its table

``count_step_flops`` runs the module's own ``training_step`` once on a real batch under torch's
``FlopCounterMode`` and takes the gradient of its loss, so every op the step dispatches is counted;
``optimizer_update_bytes`` reads the optimizer's real state, so each optimizer moves what it actually keeps;
``GPU_PEAKS`` / ``peak_for`` give the datasheet peak of the device torch reports, for the step's dtype. What the
roofline table shows: docs/output.md.
"""

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step, as ``FlopCounterMode`` counts them (matmuls, convolutions, attention).

    Attributes:
        forward: FLOPs of ``training_step``, loss included.
        backward: FLOPs of the gradient of the loss with respect to the trainable parameters.
    """

    forward: int
    backward: int


def count_step_flops(pl_module: LightningModule, batch: Any, batch_idx: int = 0) -> Optional[StepFlops]:
    """Counts the FLOPs of one forward and backward of ``pl_module.training_step`` on ``batch``.

    Runs ``training_step(batch, batch_idx)`` once under ``FlopCounterMode`` (the forward), then
    ``torch.autograd.grad`` of its loss with respect to the parameters that require grad (the backward),
    and reads the counter in between. Safe to call from a callback hook in the middle of a fit, on a
    module that Lightning has wrapped in ``DistributedDataParallel``:

    - ``training_step`` is the LightningModule's own method, so DDP's ``forward`` (buffer broadcast,
      ``prepare_for_backward``) does not run.
    - ``torch.autograd.grad`` returns the gradients instead of accumulating them: ``.grad`` is untouched
      and the ``AccumulateGrad`` nodes, whose post-hooks are DDP's reducer hooks, never run, so nothing is
      all-reduced. Hooks registered with ``Tensor.register_hook`` on a parameter do run, as they would in
      any backward; Lightning (2.6) and lit_ddp register none.
    - torch's CPU generator and those of the module's accelerators are forked, so a dropout in the step
      does not shift the training run's random stream (Python's and NumPy's generators are not).
    - Every buffer (e.g. BatchNorm's running statistics) is put back to its previous tensor and values.

    What the step does besides computing (``self.log``, a torchmetrics update, a cached plain attribute) is
    its own and is not undone. A step that runs collectives (e.g. ``SyncBatchNorm``) must be counted on
    every rank at once, like the training step itself. The step runs outside Lightning's precision context
    (autocast): the counts do not depend on the dtype, only on the shapes.

    Args:
        pl_module: The module whose ``training_step`` to count; already on its training device.
        batch: A batch as the training loop passes it to ``training_step``, on the module's device.
        batch_idx: Passed on to ``training_step``.

    Returns:
        The forward and backward FLOPs, or ``None`` when ``training_step`` returns ``None`` (Lightning's
        way of skipping a batch: there is no loss, hence no backward to count).

    Raises:
        TypeError: ``training_step`` returned neither a tensor, a mapping with ``"loss"``, nor ``None``.
        ValueError: The loss is not a scalar, does not require grad, or the module has no trainable
            parameter.
    """
    params = [p for p in pl_module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"`count_step_flops`: {type(pl_module).__name__} has no parameter that requires grad")
    # display=False: the counter would otherwise print a per-module table on exit, from every rank.
    counter = FlopCounterMode(display=False)
    with _untouched(pl_module), torch.enable_grad(), counter:
        loss = _loss_of(pl_module.training_step(batch, batch_idx))
        if loss is None:
            return None
        forward = counter.get_total_flops()
        if loss.dim() != 0:
            raise ValueError(
                f"`count_step_flops`: training_step's loss must be a scalar, got shape {tuple(loss.shape)}"
            )
        if not loss.requires_grad:
            raise ValueError(
                f"`count_step_flops`: training_step's loss ({loss!r}) does not require grad: no backward to count"
            )
        # Not loss.backward(): it accumulates into .grad and runs the AccumulateGrad post-hooks. Between DDP's
        # forward and the real backward (e.g. from on_before_backward) those hooks all-reduce this probe's
        # gradients and mark the buckets done, so the real backward's gradients are then never all-reduced,
        # silently (checked on torch 2.13, gloo, 2 ranks).
        torch.autograd.grad(loss, params, allow_unused=True)
        backward = counter.get_total_flops() - forward
    return StepFlops(forward=forward, backward=backward)


class RealStepFlops:
    """Counts the FLOPs of a real training step while it runs, for manual optimization: its ``training_step`` runs
    its own ``manual_backward`` and ``optimizer.step()``, so it cannot be run again as a probe
    (``count_step_flops``: that would train the model once more, outside the fit).

    ``start`` before the step's first forward, ``backward_start`` / ``backward_end`` around each backward (what is
    counted between them is backward, the rest forward), ``stop`` when the step is done. The optimizer's update
    runs inside the count; its elementwise ops are not in ``FlopCounterMode``'s table (matmuls, convolutions,
    attention), so it adds nothing. The count's own cost falls in the step it counts: step 0, the warm-up.
    """

    def __init__(self) -> None:
        self._counter: Optional[FlopCounterMode] = None
        self._backward = 0
        self._since: Optional[int] = None

    @property
    def active(self) -> bool:
        return self._counter is not None

    def start(self) -> None:
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def backward_start(self) -> None:
        if self._counter is not None:
            self._since = self._counter.get_total_flops()

    def backward_end(self) -> None:
        if self._counter is not None and self._since is not None:
            self._backward += self._counter.get_total_flops() - self._since
            self._since = None

    def stop(self) -> Optional[StepFlops]:
        """The step's FLOPs (None if it was not started); the count ends, also when the step failed."""
        counter, self._counter = self._counter, None
        if counter is None:
            return None
        counter.__exit__(None, None, None)
        total = counter.get_total_flops()
        return StepFlops(forward=total - self._backward, backward=self._backward)


def _loss_of(output: Any) -> Optional[Tensor]:
    """The loss of a ``training_step`` output, as Lightning's automatic optimization reads it."""
    if output is None or isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    raise TypeError(
        "`count_step_flops`: training_step must return a tensor, a mapping with a tensor under 'loss', or None;"
        f" got {type(output).__name__}: {output!r}"
    )


@contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Restores ``module``'s buffers and torch's RNG streams of its devices when the block exits."""
    saved = [
        (owner, name, buf, buf.detach().clone())
        for owner in module.modules()
        for name, buf in owner.named_buffers(recurse=False)
    ]
    accelerators: dict[str, set[int]] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type not in ("cpu", "meta"):
            index = tensor.device.index if tensor.device.index is not None else 0
            accelerators.setdefault(tensor.device.type, set()).add(index)
    # fork_rng always forks the CPU generator. Naming the devices keeps it from initialising every visible
    # GPU (slow, and needless for a module on one device); a CPU module names none.
    forks = sorted(accelerators.items()) or [("cuda", set())]
    with ExitStack() as stack:
        for device_type, indices in forks:
            stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=device_type))
        try:
            yield
        finally:
            for owner, name, buf, value in saved:
                if getattr(owner, name) is not buf:  # the step replaced the buffer instead of updating it
                    setattr(owner, name, buf)
                # Through .data, which has its own version counter: a plain copy_ would bump the buffer's, and a
                # graph still waiting for its backward (the real step's, when called from on_before_backward)
                # that saved the buffer, as BatchNorm saves its running statistics, would then refuse to run
                # ("modified by an inplace operation"). That graph sees the very values it saved.
                buf.data.copy_(value)


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
