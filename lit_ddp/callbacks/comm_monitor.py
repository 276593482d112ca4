"""What DDP's gradient all-reduce costs: buckets, bytes, time, bandwidth, and how much of it is exposed.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2

Registers a DDP communication hook on the wrapped model (any Lightning DDP strategy) that performs the all-reduce
itself and times each bucket: CUDA events on GPUs, ``perf_counter`` on CPU; with ``compression`` (or a strategy's
fp16/bf16 hook) the bucket is cast before the timed all-reduce. It records each bucket's hand-over on the host
clock too, for the straggler: on GPUs when the gradients were ready on the GPU, not when the host queued them.
NCCL runs the buckets one after another on one stream: a bucket's transfer starts when it is ready and the one
before it is done.
Rank 0 writes ``comm.json`` (a ``CommRecord``) and prints the all-reduce table (``lit_ddp.present.comm``). What
each figure means: docs/output.md; the straggler: docs/stragglers.md; a step: docs/architecture.md.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.profiler import record_function
from typing_extensions import override

from lit_ddp import _lightning
from lit_ddp.callbacks import end_of_fit
from lit_ddp.callbacks.shared import gather_to_zero, log_metrics, meta, profiled_steps
from lit_ddp.callbacks.step_sync import StepSync
from lit_ddp.maths.intervals import union_length
from lit_ddp.measure import clock
from lit_ddp.measure.clock import ClockOffset, CudaClock, HostClock, clock_for
from lit_ddp.measure.gradients import check_all_used, without_grad
from lit_ddp.measure.memory import ddp_memory
from lit_ddp.records.ranges import BUCKET_PREFIX
from lit_ddp.records.schema import CommRecord, RankComm, Sketch, StepBuckets
from lit_ddp.records.steps import Window, is_steady
from lit_ddp.run import console
from lit_ddp.run.lean import LeanCallback

COMPRESSION_WRAPPERS = {
    "fp16": default_hooks.fp16_compress_wrapper,
    "bf16": default_hooks.bf16_compress_wrapper,
}
# torch's casting hooks, as a strategy is given them (``ddp_comm_hook``): each is its wrapper around the plain
# all-reduce. Taken apart, so that the cast stays outside the timed all-reduce and the record names it.
COMPRESSION_HOOKS = {
    default_hooks.fp16_compress_hook: "fp16",
    default_hooks.bf16_compress_hook: "bf16",
}
CASTS = {**COMPRESSION_HOOKS, **{wrapper: name for name, wrapper in COMPRESSION_WRAPPERS.items()}}


class TimedHook(NamedTuple):
    """What CommMonitor times: ``hook`` (the all-reduce, or a hook it cannot see inside) and the ``cast`` around it."""

    hook: Callable
    cast: Optional[str]
    opaque: bool  # a hook of the user's (PowerSGD, ...): timed from outside, its bytes the uncompressed buckets'


def split_cast(hook: Optional[Callable], wrapper: Optional[Callable], compression: Optional[str]) -> TimedHook:
    """The strategy's ``ddp_comm_hook`` and ``ddp_comm_wrapper`` with CommMonitor's ``compression``, as what is
    timed and the cast outside it. Two casts (a casting hook or wrapper, and ``compression``) are refused."""
    casts = [name for name in (_cast_of(hook), _cast_of(wrapper), compression) if name is not None]
    if len(casts) > 1:
        raise ValueError(
            f"CommMonitor(compression={compression!r}) with the strategy's ddp_comm_hook={_name(hook)} and "
            f"ddp_comm_wrapper={_name(wrapper)}: {len(casts)} casts of the gradients ({', '.join(casts)}); give one"
        )
    inner = hook if hook is not None and _cast_of(hook) is None else default_hooks.allreduce_hook
    if wrapper is not None and _cast_of(wrapper) is None:  # a wrapper of the user's: part of what is timed
        inner = wrapper(inner)
    opaque = inner is not default_hooks.allreduce_hook
    return TimedHook(inner, casts[0] if casts else None, opaque)


def _cast_of(function: Optional[Callable]) -> Optional[str]:
    try:
        return CASTS.get(function)
    except TypeError:  # an unhashable callable of the user's: no cast of torch's
        return None


def _name(function: Optional[Callable]) -> str:
    return getattr(function, "__qualname__", repr(function)) if function is not None else "None"


@dataclass
class BucketTiming:
    """One bucket's all-reduce in one step, on this rank; marks of the monitor's clock."""

    step: int
    index: int
    nbytes: int
    backward_start: Any
    start: Any  # handed to the hook: the bucket's gradients are ready
    arrival: Optional[float]  # the same moment on the host clock, comparable across ranks (CUDA: resolved later)
    end: Any = None  # the all-reduce's future completed
    micro: int = 0  # the step's backward pass (micro-batch) that handed the bucket over


class CommMonitor(LeanCallback):
    """Times and accounts every gradient bucket's all-reduce. With a strategy that is not DDP's (one device,
    ``SingleDeviceStrategy``) there is no all-reduce: it stands aside with one warning, and writes no record.

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
        self._backwards: dict[int, int] = {}  # step -> backward passes it ran so far
        self._wire_dtype: Optional[str] = None
        self._lock: Optional[threading.Lock] = None  # made in setup: ddp_spawn pickles callbacks, locks don't
        self._timings: list[BucketTiming] = []  # appended by the futures' callbacks, taken by _collect
        self._open: list[BucketTiming] = []  # handed over, all-reduce not done yet
        self._pending: dict[int, list[BucketTiming]] = {}  # steps whose marks are not resolved yet
        self._window = Window()
        self._summaries: dict[tuple[int, ...], dict[str, Sketch]] = {}  # per bucket layout
        self._profiled: Optional[range] = None
        self._unused: list[tuple[str, int]] = []  # parameters without a gradient in the last backward
        self._unused_sets: set[tuple[str, ...]] = set()  # every step's, to tell a fixed set from a changing one
        self._offsets: list[ClockOffset] = []  # on rank 0: every rank's clock against its own
        self.record: Optional[CommRecord] = None  # rank 0's, once training ended
        self.log_dir: Optional[str] = None
        self._hook: Any = None
        self._serial = False  # NCCL: the buckets' all-reduces run one after another on one stream
        self._cast: Optional[str] = compression  # the cast outside the timed all-reduce: this or the strategy's
        self.standing_aside = False  # this fit's strategy is not DDP: no hook, no record

    @staticmethod
    def unsupported(trainer: Trainer) -> Optional[str]:
        """Why this callback cannot work with ``trainer``'s strategy, or None."""
        strategy = trainer.strategy
        if not isinstance(strategy, DDPStrategy):
            return f"CommMonitor times DDP's gradient buckets and needs a DDP strategy, got {type(strategy).__name__}"
        return None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        reason = self.unsupported(trainer)
        self.standing_aside = reason is not None
        if reason:
            # A user debugging on one device keeps their callbacks list: one line, and the others still run.
            rank_zero_warn(f"{reason}: it stands aside", stacklevel=5)  # Lightning's hook call: one line, as its own
            self.record = None  # no record, so EndOfFit has none to wait for
            return
        self._clock = clock_for(trainer.strategy.root_device)
        # NCCL queues every bucket's all-reduce on one stream, back to back; gloo's worker threads may overlap them.
        self._serial = dist.is_initialized() and dist.get_backend() == "nccl"
        self._lock = threading.Lock()  # gloo completes futures on its own threads
        # Lightning 2.6 broadcasts a SIGTERM flag from rank 0 at every step: every rank would wait for a straggler
        # there, between steps, and arrive together at the all-reduce. StepSync replaces it (and carries SIGTERM).
        StepSync.attach(trainer, self)
        # Take over the hook the strategy would register (DDP accepts one only) and time it, a cast outside it.
        configured = _lightning.configured_comm_hook(trainer.strategy)
        timed = split_cast(configured.hook, configured.wrapper, self.compression)
        if timed.opaque:
            rank_zero_warn(f"CommMonitor times the strategy's communication hook {_name(configured.hook)} from "
                           "outside: its bytes are the uncompressed buckets' and its time includes the hook's own "
                           "work, so its bandwidth is not the wire's", stacklevel=5)  # fmt: skip
        _lightning.set_comm_hook(trainer.strategy, None)
        self._cast = timed.cast
        self._hook = (configured.state, self._timed(timed.hook, timed.cast))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.standing_aside:
            return
        state, hook = self._hook
        trainer.strategy.model.register_comm_hook(state, hook)
        # Once, before the first step: where each rank's clock stands against rank 0's (arrivals compare then).
        distributed = trainer.world_size > 1 and dist.is_initialized()
        self._offsets = clock.offsets_to_rank0(trainer.strategy.root_device) if distributed else []
        if isinstance(self._clock, CudaClock):
            self._clock.anchor()  # events to host time, for the arrivals: one synchronize, before the first step
        self._timings, self._pending, self._summaries, self._profiled = [], {}, {}, None
        self._collected_at = trainer.global_step
        self._backwards, self._wire_dtype = {}, None
        self.record = None  # this fit's, once it ends (rank 0's)
        end_of_fit.owner(trainer).expect(self)
        self._unused, self._unused_sets = [], set()
        self._window = Window()

    def waiting_for(self) -> Optional[str]:
        """The all-reduce this rank is waiting for, if any (``lit_ddp.run.hangs`` names it after a timeout). On
        gloo only: NCCL completes a bucket's future when the all-reduce is queued, so none is ever open, and its
        timeout ends the process from NCCL's watchdog, not as an exception here (docs/failures.md)."""
        if self._serial:
            return None
        with self._lock:
            first = min(self._open, key=lambda t: (t.step, t.index), default=None)
        return f"the all-reduce of bucket {first.index} in step {first.step}" if first else None

    def _timed(self, hook, cast: Optional[str]):
        on_gpu = isinstance(self._clock, CudaClock)  # the arrival is when the GPU got there: resolved in _add

        def timed(state, bucket):
            buffer = bucket.buffer()
            timing = BucketTiming(
                self._step, bucket.index(), buffer.numel() * buffer.element_size(), self._backward_start,
                self._clock.mark(), None if on_gpu else clock.host_now(), micro=self._backwards.get(self._step, 1) - 1,
            )  # fmt: skip
            self._wire_dtype = str(buffer.dtype).removeprefix("torch.")
            with self._lock:
                self._open.append(timing)

            def done(fut):
                timing.end = self._clock.mark()
                with self._lock:
                    self._open.remove(timing)
                    self._timings.append(timing)
                return fut.value()

            # A range of a stable name, for any trace viewer and lit_ddp.derive.trace: the all-reduce this
            # bucket queued.
            with record_function(f"{BUCKET_PREFIX}{bucket.index()}"):
                return hook(state, bucket).then(done)

        # The cast happens outside the timed hook: the timed all-reduce sees the compressed buffer.
        return COMPRESSION_WRAPPERS[cast](timed) if cast else timed

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.standing_aside:
            return
        self._step = trainer.global_step
        # The window's work (buckets to rows, summaries, the loggers' rows) in one go every log_every_n_steps steps
        # (Lightning's cadence for logged step metrics), not a piece of it in every step.
        if self._step - self._collected_at >= max(1, trainer.log_every_n_steps):
            self._collect(trainer, block=False)
            self._collected_at = self._step

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.standing_aside:
            return
        self._backward_start = self._clock.mark()
        self._backwards[self._step] = self._backwards.get(self._step, 0) + 1

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.standing_aside:
            return
        if not trainer.strategy.model.find_unused_parameters:
            if trainer.global_step == 0:  # DDP would fail at the next forward, naming indices: name them now
                check_all_used(pl_module, 0, console.advice(trainer))
            return
        self._unused = without_grad(pl_module)  # a Python pass over the parameters, only where DDP searches anyway
        self._unused_sets.add(tuple(name for name, _ in self._unused))

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.standing_aside or self._lock is None:  # the launching process of ddp_fork/ddp_spawn never set up
            return
        try:  # the window's finished steps to the loggers: a failed run's buckets are the ones looked at
            self._collect(trainer, block=False)
        except RuntimeError as error:  # a CUDA error is sticky: no event can be read after it
            rank_zero_warn(f"CommMonitor: the last window's buckets were not logged ({error})")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.standing_aside:
            return
        self._collect(trainer, block=True)
        self.log_dir = trainer.log_dir  # a broadcast: every rank asks
        rows = [row for _, row in self._window.items()]
        final = tuple(rows[-1].bytes) if rows else ()
        ranks = gather_to_zero(trainer, RankComm(trainer.global_rank, rows, self._summaries.get(final, {})))
        if ranks is None or not rows:
            return
        self.record = CommRecord(
            meta=meta(trainer, self._clock.name),
            ranks=ranks,
            layout=list(final),
            param_bytes=sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad),
            compression=self._cast,
            first_layout=rows[0].bytes,
            profiled_steps=list(self._profiled or ()),
            clock_offset_s=[o.offset_s for o in self._offsets] or [0.0],
            clock_error_s=[o.error_s for o in self._offsets] or [0.0],
            find_unused_parameters=bool(trainer.strategy.model.find_unused_parameters),
            unused=[name for name, _ in self._unused],
            unused_bytes=sum(nbytes for _, nbytes in self._unused),
            unused_every_step=len(self._unused_sets) == 1,
            wire_dtype=self._wire_dtype,
            ddp_memory=ddp_memory(trainer.strategy.model, trainer.optimizers, self._cast),
        )

    def _collect(self, trainer: Trainer, block: bool) -> None:
        """Turns the buckets of finished steps into the record's rows and summaries, oldest first, as far as
        their marks have completed (``block``: all, waiting for them)."""
        with self._lock:
            timings, self._timings = self._timings, []
        for timing in timings:
            self._pending.setdefault(timing.step, []).append(timing)
        for step in sorted(self._pending):
            buckets = sorted(self._pending[step], key=lambda t: t.index)
            if not block and (step >= self._step or not all(self._clock.ready(b.end) for b in buckets)):
                return  # the step still running, or marks still on their way
            if block:
                for bucket in buckets:
                    self._clock.wait(bucket.end)
            del self._pending[step]
            self._add(trainer, step, buckets)

    def _transfer_ms(self, buckets: list[BucketTiming]) -> list[float]:
        """Each bucket's all-reduce, ms: from its hand-over to its end; on NCCL from when it could start, its
        hand-over or the end of the bucket before it on the one stream, whichever is later (DDP launches the
        buckets in index order), so that a later bucket's queue is not counted as its transfer."""
        ms = self._clock.elapsed_ms
        found, before = [], None
        for bucket in buckets:
            start = bucket.start
            if self._serial and before is not None and ms(start, before.end) > 0:
                start = before.end
            found.append(ms(start, bucket.end))
            before = bucket
        return found

    def _add(self, trainer: Trainer, step: int, buckets: list[BucketTiming]) -> None:
        ms = self._clock.elapsed_ms
        spans = [(ms(buckets[0].start, b.start), ms(buckets[0].start, b.end)) for b in buckets]
        row = StepBuckets(
            step=step,
            bytes=[b.nbytes for b in buckets],
            ms=self._transfer_ms(buckets),
            ready_ms=[ms(b.backward_start, b.start) if b.backward_start is not None else 0.0 for b in buckets],
            busy_ms=union_length(spans),
            exposed_ms=max(end for _, end in spans) - max(start for start, _ in spans),
            arrival_s=[b.arrival if b.arrival is not None else self._clock.host_seconds(b.start) for b in buckets],
            micro_batches=self._backwards.pop(step, 1),
            synced=sorted({b.micro for b in buckets}),
        )
        self._window.add(step, row)
        if self._profiled is None:  # PhaseTimer's on_train_start has run by the first step's end, wherever listed
            self._profiled = profiled_steps(trainer)
            self._window.profiled = set(self._profiled)
        if is_steady(step, self._profiled):
            # DDP's first step runs on its construction-time buckets, then it rebuilds them in the order gradients
            # became ready: a summary belongs to one layout (the same on every rank).
            summaries = self._summaries.setdefault(tuple(row.bytes), {})
            figures = {"busy_ms": row.busy_ms, "exposed_ms": row.exposed_ms, "total_ms": sum(row.ms)}
            for b, (t, ready) in enumerate(zip(row.ms, row.ready_ms, strict=True)):
                figures[f"bucket{b}.ms"], figures[f"bucket{b}.ready_ms"] = t, ready
            for name, value in figures.items():
                summaries.setdefault(name, Sketch()).add(value)
        metrics = {"comm/bytes": float(sum(row.bytes)), "comm/busy_ms": row.busy_ms,
                   "comm/exposed_ms": row.exposed_ms, "comm/max_bucket_ms": max(row.ms)}  # fmt: skip
        log_metrics(trainer, metrics, step=step)
