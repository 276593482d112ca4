"""What DDP's gradient all-reduce costs: buckets, bytes, time, bandwidth, and how much of it is exposed.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

CommMonitor registers a DDP communication hook that performs the all-reduce itself (DDP's own
``allreduce_hook``, or the strategy's configured hook) and times each bucket: CUDA events on GPUs (recorded
when the bucket is handed over, and in the future's callback, which runs once the collective is done on
the device), ``perf_counter`` on CPU. With ``compression`` the bucket is cast to fp16/bf16 *before* the
timed all-reduce, so the bytes are those on the wire.

Per step: buckets, bytes reduced S, time per bucket, algbw = S / t and busbw = algbw * 2(n-1)/n (the
nccl-tests definitions), the bytes each rank sends in a ring all-reduce, 2(n-1)/n * S (the notes' "2x the
parameter size per step"), the time communication was busy, and how much was exposed: the time from the
moment the last bucket was handed over (backward's compute is done by then) to the end of the last
all-reduce. Earlier buckets overlap with the remaining backward compute; that part is hidden.
"""

import json
import logging
import threading
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from typing_extensions import override

from lit_ddp import report
from lit_ddp.callbacks.clock import HostClock, clock_for
from lit_ddp.strategy import LitDDPStrategy

log = logging.getLogger(__name__)

COMPRESSION_WRAPPERS = {
    "fp16": default_hooks.fp16_compress_wrapper,
    "bf16": default_hooks.bf16_compress_wrapper,
}


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
        self._lock: threading.Lock | None = None  # made in setup: ddp_spawn pickles callbacks, locks don't pickle
        self._records: list[tuple[int, int, int, Any, Any]] = []  # step, bucket, bytes, start mark, end mark

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, LitDDPStrategy):
            raise TypeError(
                "CommMonitor needs `strategy=LitDDPStrategy(...)` to register its comm hook, "
                f"got {type(strategy).__name__}"
            )
        self._clock = clock_for(strategy.root_device)
        self._lock = threading.Lock()  # gloo completes futures on its own threads
        strategy.wrap_comm_hook(self._wrap)

    def _wrap(self, hook):
        def timed(state, bucket):
            buffer = bucket.buffer()
            start = self._clock.mark()
            record = [self._step, bucket.index(), buffer.numel() * buffer.element_size(), start, None]

            def done(fut):
                record[4] = self._clock.mark()
                with self._lock:
                    self._records.append(tuple(record))
                return fut.value()

            return hook(state, bucket).then(done)

        # The cast happens outside the timed hook: the timed all-reduce sees the compressed buffer.
        return COMPRESSION_WRAPPERS[self.compression](timed) if self.compression else timed

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = self._gather(trainer, pl_module)
        log_dir = trainer.log_dir  # a broadcast: every rank asks
        if data is None or not trainer.is_global_zero:
            return
        log.info(report.comm_table(data))
        if trainer.logger is not None:
            for i, step in enumerate(data["steps"]):
                bucket_ms = data["ms"][0][i]
                trainer.logger.log_metrics(
                    {
                        "comm/bytes": float(sum(data["bucket_bytes_per_step"][i])),
                        "comm/busy_ms": data["busy_ms"][0][i],
                        "comm/exposed_ms": data["exposed_ms"][0][i],
                        "comm/max_bucket_ms": max(bucket_ms),
                    },
                    step=step,
                )
        if log_dir is not None:
            path = Path(log_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))

    def per_step(self) -> dict[int, list[tuple[int, int, float, float]]]:
        """This rank's buckets per step: (bucket index, bytes, start ms, end ms), times from the first start."""
        if self._records:
            self._clock.wait(max(self._records, key=lambda r: (r[0], r[1]))[4])
        records = sorted(self._records, key=lambda r: (r[0], r[1]))
        if not records:
            return {}
        origin = records[0][3]
        steps: dict[int, list] = {}
        for step, index, nbytes, start, end in records:
            ms = self._clock.elapsed_ms
            steps.setdefault(step, []).append((index, nbytes, ms(origin, start), ms(origin, end)))
        return steps

    def _gather(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any] | None:
        steps = self.per_step()
        if not steps:
            return None
        # DDP's first step runs on its construction-time buckets, then it rebuilds them in the order gradients
        # became ready; so layouts can differ between steps (never between ranks). Pad to the widest.
        order = sorted(steps)
        width = max(len(b) for b in steps.values())
        rows = []
        for s in order:
            buckets = sorted(steps[s])
            durations = [end - start for _, _, start, end in buckets]
            busy = _union_ms([(start, end) for _, _, start, end in buckets])
            exposed = max(end for *_, end in buckets) - max(start for _, _, start, _ in buckets)
            rows.append([*durations, *[-1.0] * (width - len(buckets)), busy, exposed])
        local = torch.tensor(rows, dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local)  # the one collective: [world, steps, width + 2]
        if gathered.dim() == local.dim():
            gathered = gathered.unsqueeze(0)
        per_rank = gathered.cpu().tolist()
        return {
            "clock": self._clock.name,
            "world_size": trainer.world_size,
            "compression": self.compression,
            "steps": order,
            "bucket_bytes_per_step": [[nbytes for _, nbytes, _, _ in sorted(steps[s])] for s in order],
            "bucket_bytes": [nbytes for _, nbytes, _, _ in sorted(steps[order[-1]])],  # the final layout
            "param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad),
            "ms": [[[t for t in row[:width] if t >= 0] for row in rank] for rank in per_rank],
            "busy_ms": [[row[width] for row in rank] for rank in per_rank],
            "exposed_ms": [[row[width + 1] for row in rank] for rank in per_rank],
        }


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total
