"""What DDP's gradient all-reduce costs: buckets, bytes, time, bandwidth, and how much of it is exposed.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

CommMonitor registers a DDP communication hook on the wrapped model (any Lightning DDP strategy: DDP takes
a hook until the first backward) that performs the all-reduce itself -- DDP's own ``allreduce_hook``, or the
hook configured on the strategy -- and times each bucket: CUDA events on GPUs (recorded when the bucket is
handed over, and in the future's callback, which runs once the collective is done on the device),
``perf_counter`` on CPU. With ``compression`` the bucket is cast to fp16/bf16 *before* the timed all-reduce,
so the bytes are those on the wire.

Per step: buckets, bytes reduced S, each bucket's ready time (from the start of backward to the hand-over),
time per bucket, algbw = S / t and busbw = algbw * 2(n-1)/n (the nccl-tests definitions), the bytes each rank
sends in a ring all-reduce, 2(n-1)/n * S (the notes' "2x the parameter size per step"), the time
communication was busy, and how much was exposed: from the hand-over of the last bucket (backward's compute
is done by then) to the end of the last all-reduce. Earlier buckets overlap with the remaining backward
compute; that part is hidden.
"""

import math
import threading
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from typing_extensions import override

from lit_ddp import _lightning, report
from lit_ddp.callbacks.clock import HostClock, clock_for
from lit_ddp.callbacks.kernels import union_ms
from lit_ddp.callbacks.results import gather, say, write_json

COMPRESSION_WRAPPERS = {
    "fp16": default_hooks.fp16_compress_wrapper,
    "bf16": default_hooks.bf16_compress_wrapper,
}


@dataclass
class BucketTiming:
    """One bucket's all-reduce in one step, on this rank; marks of the monitor's clock."""

    step: int
    index: int
    nbytes: int
    backward_start: Any
    start: Any  # handed to the hook: the bucket's gradients are ready
    end: Any = None  # the all-reduce's future completed


class CommMonitor(Callback):
    """Times and accounts every gradient bucket's all-reduce.

    Args:
        compression: Cast gradients to ``fp16`` or ``bf16`` for the all-reduce (half the bytes on the wire).
        filename: Name of the JSON written in the run's log dir.
    """

    def __init__(self, compression: Optional[Literal["fp16", "bf16"]] = None, filename: str = "comm.json") -> None:
        if compression is not None and compression not in COMPRESSION_WRAPPERS:
            raise ValueError(f"`CommMonitor(compression={compression!r})` must be one of {list(COMPRESSION_WRAPPERS)}")
        self.compression = compression
        self.filename = filename
        self._clock: Any = HostClock()
        self._step = 0
        self._backward_start: Any = None
        self._lock: Optional[threading.Lock] = None  # made in setup: ddp_spawn pickles callbacks, locks don't
        self._timings: list[BucketTiming] = []
        self._hook: Any = None

    @staticmethod
    def unsupported(trainer: Trainer) -> Optional[str]:
        """Why this callback cannot work with ``trainer``'s strategy, or None."""
        strategy = trainer.strategy
        if not isinstance(strategy, DDPStrategy):
            return f"CommMonitor times DDP's gradient buckets and needs a DDP strategy, got {type(strategy).__name__}"
        return None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        reason = self.unsupported(trainer)
        if reason:
            raise MisconfigurationException(reason)
        self._clock = clock_for(trainer.strategy.root_device)
        self._lock = threading.Lock()  # gloo completes futures on its own threads
        # Take over the hook the strategy would register (DDP accepts one only) and time it.
        configured = _lightning.configured_comm_hook(trainer.strategy)
        hook = configured.hook or default_hooks.allreduce_hook
        if configured.wrapper is not None:
            hook = configured.wrapper(hook)
        _lightning.set_comm_hook(trainer.strategy, None)
        self._hook = (configured.state, self._timed(hook))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state, hook = self._hook
        trainer.strategy.model.register_comm_hook(state, hook)
        self._timings = []

    def _timed(self, hook):
        def timed(state, bucket):
            buffer = bucket.buffer()
            timing = BucketTiming(
                self._step, bucket.index(), buffer.numel() * buffer.element_size(), self._backward_start,
                self._clock.mark(),
            )  # fmt: skip

            def done(fut):
                timing.end = self._clock.mark()
                with self._lock:
                    self._timings.append(timing)
                return fut.value()

            return hook(state, bucket).then(done)

        # The cast happens outside the timed hook: the timed all-reduce sees the compressed buffer.
        return COMPRESSION_WRAPPERS[self.compression](timed) if self.compression else timed

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._backward_start = self._clock.mark()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = self._summary(trainer, pl_module)
        if data is None:
            return
        write_json(trainer, self.filename, data)
        say(trainer, report.comm_table(data))
        if trainer.is_global_zero and trainer.logger is not None:
            for i, step in enumerate(data["steps"]):
                trainer.logger.log_metrics(
                    {
                        "comm/bytes": float(sum(data["bucket_bytes_per_step"][i])),
                        "comm/busy_ms": data["busy_ms"][0][i],
                        "comm/exposed_ms": data["exposed_ms"][0][i],
                        "comm/max_bucket_ms": max(data["ms"][0][i]),
                    },
                    step=step,
                )

    def per_step(self) -> dict[int, list[BucketTiming]]:
        """This rank's buckets per step, in bucket order, every mark completed."""
        timings = sorted(self._timings, key=lambda t: (t.step, t.index))
        if timings:
            self._clock.wait(timings[-1].end)
        steps: dict[int, list[BucketTiming]] = {}
        for timing in timings:
            steps.setdefault(timing.step, []).append(timing)
        return steps

    def _summary(self, trainer: Trainer, pl_module: LightningModule) -> Optional[dict[str, Any]]:
        steps = self.per_step()
        if not steps:
            return None
        # DDP's first step runs on its construction-time buckets, then it rebuilds them in the order gradients
        # became ready; so layouts can differ between steps (never between ranks). Pad to the widest.
        order = sorted(steps)
        width = max(len(b) for b in steps.values())
        ms = self._clock.elapsed_ms
        nan = float("nan")
        durations, ready, busy, exposed = [], [], [], []
        for s in order:
            buckets = steps[s]
            pad = [nan] * (width - len(buckets))
            durations.append([ms(b.start, b.end) for b in buckets] + pad)
            ready.append(
                [ms(b.backward_start, b.start) if b.backward_start is not None else 0.0 for b in buckets] + pad
            )
            spans = [(ms(buckets[0].start, b.start), ms(buckets[0].start, b.end)) for b in buckets]
            busy.append(union_ms(spans))
            exposed.append(max(end for _, end in spans) - max(start for start, _ in spans))
        gathered = gather(trainer, {"ms": durations, "ready_ms": ready, "busy_ms": busy, "exposed_ms": exposed})
        for name in ("ms", "ready_ms"):  # drop the padding of steps with fewer buckets
            gathered[name] = [[[t for t in row if not math.isnan(t)] for row in rank] for rank in gathered[name]]
        return {
            "clock": self._clock.name,
            "world_size": trainer.world_size,
            "compression": self.compression,
            "steps": order,
            "bucket_bytes_per_step": [[b.nbytes for b in steps[s]] for s in order],
            "bucket_bytes": [b.nbytes for b in steps[order[-1]]],  # the final layout
            "param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad),
            **gathered,
        }
