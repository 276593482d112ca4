"""One DDP configuration measured on the user's own model, in the ranks already started: the tuner's trials.

    python -m lit_ddp.tune --devices 2        # lit_ddp.tuner.DDPTuner runs a TrialBench on every rank

Every trial starts from the same weights and the same batch, wraps the module in a fresh
``DistributedDataParallel`` with its knobs on the one process group, builds a fresh optimizer like the user's, and
times whole steps (zero_grad, forward, backward with its all-reduce, update; on CUDA synchronized at the step's
end, which a tuner may do) and the update alone (``optimizer.step()``; on CUDA between two events). Every rank's
times are all-reduced (max: a step lasts as long as its slowest rank), so every rank sees the same numbers and
takes the same path through the search.
"""

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.nn.parallel import DistributedDataParallel

from lit_ddp.measure.memory import ddp_memory
from lit_ddp.run.ddp_options import buffer_sync, powersgd
from lit_ddp.tuner.knobs import Knobs
from lit_ddp.tuner.trial import Trial

HOOKS = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "noop": debugging_hooks.noop_hook,
}


class _TrainingStep(nn.Module):
    """The LightningModule's ``training_step`` as a forward, for DDP to wrap (as Lightning's own wrapper does)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> Tensor:
        out = self.module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise TypeError(f"training_step returned {type(out).__name__}: the tuner needs the loss (a Tensor)")
        return loss


def comm_hook(name: str, warmup: int) -> tuple[Any, Callable] | None:
    """The state and hook of a trial's ``comm_hook`` (None: DDP's own all-reduce). PowerSGD compresses from the
    first timed step: the ``warmup`` untimed ones (``DDPTuner`` asks for 2 or more) all-reduce plainly."""
    if name.startswith("powersgd"):
        return powersgd(int(name.removeprefix("powersgd")), max(2, warmup))
    return (None, HOOKS[name]) if name in HOOKS else None


def optimizer_impls(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The implementations ``optimizer``'s class takes (torch's Adam, AdamW, SGD: foreach and fused)."""
    return tuple(impl for impl in ("foreach", "fused") if impl in optimizer.defaults)


def _fresh_optimizer(like: torch.optim.Optimizer, impl: str) -> torch.optim.Optimizer:
    groups = [{k: v for k, v in group.items()} for group in like.param_groups]
    if impl != "as_configured":
        for group in groups:
            group["foreach"], group["fused"] = impl == "foreach", impl == "fused"
    return type(like)(groups)


@contextmanager
def no_logging(module: nn.Module) -> Iterator[None]:
    """``self.log`` is a no-op while the tuner steps outside Lightning's loop (it has no result collection)."""
    module.log, module.log_dict = (lambda *a, **k: None), (lambda *a, **k: None)
    try:
        yield
    finally:
        del module.log, module.log_dict


class TrialBench:
    """Measures ``Knobs`` on ``module`` (a LightningModule) with ``batch`` and an optimizer like ``optimizer``.

    Args:
        steps: Timed steps per round, after ``warmup`` untimed ones (DDP rebuilds its buckets in the first).
        rounds: Rounds per ``measure`` when it is not told (the search asks for one at a time, interleaved).
    """

    def __init__(self, module: nn.Module, batch: Any, optimizer: torch.optim.Optimizer, device: torch.device,
                 steps: int, warmup: int, rounds: int,
                 step_context: Callable[[], AbstractContextManager] = nullcontext) -> None:  # fmt: skip
        self.module, self.batch, self.optimizer, self.device = module, batch, optimizer, device
        self.steps, self.warmup, self.rounds = steps, warmup, rounds
        self.step_context = step_context  # the Trainer's precision (autocast under 16-mixed/bf16-mixed), as fit's
        self.start = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.seed = torch.initial_seed()  # every round draws the same dropout masks: the weights compare
        self.reference: list[Tensor] | None = None  # the user's configuration's weights after a round

    def measure(self, knobs: Knobs, rounds: int | None = None) -> Trial:
        """``knobs`` in ``rounds`` rounds (the bench's own number when None)."""
        trial = Trial(knobs)
        began = time.perf_counter()
        for _ in range(self.rounds if rounds is None else rounds):
            times, updates, loss, memory, peak = self._round(knobs)
            trial.samples_ms += times
            trial.update_ms += updates
            trial.rounds_ms.append(statistics.median(times))
            trial.loss, trial.ddp_bytes, trial.peak_bytes = loss, memory, peak
        weights = [p.detach().clone() for p in self.module.parameters()]
        trial.in_sync = _in_sync(weights)
        if self.reference is None and knobs.comm_hook == "none":
            self.reference = weights
        if self.reference is not None:
            trial.max_dw = max((w - r).abs().max().item() for w, r in zip(weights, self.reference, strict=True))
        self.module.load_state_dict(self.start)
        trial.seconds = self._reduce([time.perf_counter() - began], dist.ReduceOp.MAX)[0]
        return trial

    def _round(self, knobs: Knobs) -> tuple[list[float], list[float], float, int, int | None]:
        self.module.load_state_dict(self.start)
        self.module.train()
        torch.manual_seed(self.seed)
        for p in self.module.parameters():
            p.grad = None
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        ddp = DistributedDataParallel(
            _TrainingStep(self.module),
            device_ids=[self.device.index] if cuda else None,
            bucket_cap_mb=knobs.bucket_cap_mb,
            gradient_as_bucket_view=knobs.gradient_as_bucket_view,
            static_graph=knobs.static_graph,
            find_unused_parameters=knobs.find_unused_parameters,
            **buffer_sync(knobs.broadcast_buffers),
        )
        hook = comm_hook(knobs.comm_hook, self.warmup)
        if hook is not None:
            ddp.register_comm_hook(*hook)
        optimizer = _fresh_optimizer(self.optimizer, knobs.optimizer)
        times, updates = [], []
        update = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        with no_logging(self.module):
            for step in range(self.warmup + self.steps):
                began = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                with self.step_context():
                    loss = ddp(self.batch)
                loss.backward()
                update_began = time.perf_counter()
                if update is not None:  # on the device's clock: the update's kernels, not their launch
                    update[0].record()
                optimizer.step()
                if update is not None:
                    update[1].record()
                    torch.cuda.synchronize(self.device)
                if step >= self.warmup:
                    times.append((time.perf_counter() - began) * 1e3)
                    updates.append(update[0].elapsed_time(update[1]) if update is not None else
                                   (time.perf_counter() - update_began) * 1e3)  # fmt: skip
        memory = ddp_memory(ddp, [optimizer]).held
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else 0
        del ddp, optimizer
        for p in self.module.parameters():  # with gradient_as_bucket_view they are views into the dropped buckets
            p.grad = None
        slowest = self._reduce([*times, *updates, float(memory), float(peak)], dist.ReduceOp.MAX)
        mean_loss = self._reduce([loss.item()], dist.ReduceOp.SUM)[0] / self._world()
        n = len(times)
        return slowest[:n], slowest[n : 2 * n], mean_loss, int(slowest[-2]), int(slowest[-1]) if cuda else None

    def _world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def _reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        """``values`` reduced over every rank (gloo on the CPU, NCCL on the device)."""
        if not dist.is_initialized():
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()


def _in_sync(weights: list[Tensor]) -> bool:
    """Every rank holds rank 0's weights, bit for bit. (Not the buffers: BatchNorm's statistics follow each rank's
    own rows in the last forward, after DDP's broadcast, whatever the knobs.)"""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    flat = torch.cat([w.reshape(-1).float() for w in weights])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))
