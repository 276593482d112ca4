"""Where one rank's GPU time went, from a torch.profiler (kineto) Chrome trace alone.

    python -m lit_ddp.trace_report runs/mini_train/version_0      # the report built on this analysis
    analyze_rank(load("rank0.pt.trace.json.gz"))                  # a RankAnalysis, times in microseconds

Reads the traces torch.profiler and Lightning's ``PyTorchProfiler`` write (``.json``, gzipped or not) with
``json`` alone, no torch, so any torch version's trace reads anywhere. The figures (span, busy, idle, compute,
communication, overlap, the three waits), how each GPU op is given to a step, a phase (the ranges of
``lit_ddp.records.phases``) and a bucket, the collectives' bandwidth, and where they differ from HTA's:
docs/traces.md. Memory per step and phase from a ``profile_memory=True`` trace: ``lit_ddp.derive.trace_memory``.
The interval union and nccl-tests' bus factors it uses are ``lit_ddp.maths.intervals`` and
``lit_ddp.maths.bus_factors``.
"""

import gzip
import json
import math
import re
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, Optional

from lit_ddp.maths.bus_factors import DIRECT, RING_ONCE, bus_factor
from lit_ddp.maths.intervals import length, merge, union_length
from lit_ddp.records import phases as phase_table
from lit_ddp.records.ranges import BUCKET_PREFIX, STEP_PREFIX

CPU_DEVICE = 0  # a [memory] event's "Device Type": c10's DeviceType (0 CPU, 1 CUDA)

KERNEL_WAIT_US = 30.0  # HTA's default consecutive_kernel_delay
GRADIENT = "gradient all-reduce"
OTHER_COLLECTIVE = "other"  # a collective's kind when it is no gradient all-reduce (not the phase of that name)

_STEP = re.compile(r"(ProfilerStep|lit_ddp\.step)#(\d+)")
_BUCKET = re.compile(re.escape(BUCKET_PREFIX) + r"(\d+)")
_NCCL = re.compile(r"nccl\w*Kernel")
# ncclKernel_AllReduce_RING_LL_Sum_float, ncclDevKernel_AllReduce_Sum_f32_RING_LL, and NCCL 2.27's symmetric-memory
# kernels, ncclSymDevKernel_AllReduce_AGxLL_R_sum_f32.
_NCCL_OP = re.compile(r"nccl(?:Sym)?(?:Dev)?Kernel_([A-Za-z]+)")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)|^(?:fit|validate|test|predict)-(\d+)-", re.I)
_GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memory", "memcpy": "memory", "gpu_memset": "memory", "memset": "memory"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
_RANGE_CATS = {"user_annotation", "cpu_op"}  # older torch writes ProfilerStep#N as a cpu_op

# c10's ScalarType names, as ProcessGroupNCCL writes them in a kernel's "dtype" argument.
DTYPE_BYTES = {"Bool": 1, "Byte": 1, "Char": 1, "QInt8": 1, "QUInt8": 1, "Short": 2, "Half": 2, "BFloat16": 2,
               "UInt16": 2, "Int": 4, "Float": 4, "QInt32": 4, "UInt32": 4, "ComplexHalf": 4, "Long": 8,
               "Double": 8, "UInt64": 8, "ComplexFloat": 8, "ComplexDouble": 16}  # fmt: skip


class TraceError(ValueError):
    """A file that cannot be analysed: not a trace, no rank, or no GPU events (``NoGpuEvents``)."""


class NoGpuEvents(TraceError):
    pass


@dataclass(frozen=True)
class GpuOp:
    """One kernel, memcpy or memset; ``launch_us`` is the CPU call that queued it (None when not linked)."""

    name: str
    kind: str  # "compute", "communication" or "memory"
    stream: int
    start_us: float
    end_us: float
    launch_us: Optional[float]
    args: dict[str, Any]

    @property
    def queued_us(self) -> float:
        return self.start_us if self.launch_us is None else self.launch_us


class MemoryEvent(NamedTuple):  # an allocation (bytes > 0) or a free (< 0) by torch's allocator
    ts_us: float
    bytes: int
    device_type: int


class Range(NamedTuple):  # a CPU range (record_function, ProfilerStep) whose name says what it holds
    name: str
    start_us: float
    end_us: float


@dataclass(frozen=True)
class Trace:
    path: Path
    rank: int
    world_size: Optional[int]
    ops: tuple[GpuOp, ...]
    ranges: tuple[Range, ...]
    memory: tuple[MemoryEvent, ...] = ()  # in time order; only with profile_memory=True


@dataclass(frozen=True)
class Breakdown:
    """The figures of the module docstring for a set of GPU ops, in microseconds."""

    span_us: float
    busy_us: float
    idle_us: float
    compute_us: float
    non_compute_us: float
    communication_us: float
    overlap_us: float
    comm_comp_overlap_pct: Optional[float]  # None without communication
    host_wait_us: float
    kernel_wait_us: float
    other_wait_us: float


@dataclass(frozen=True)
class Collective:
    step: Optional[int]
    name: str  # all_reduce, broadcast, ... (nccl-tests' names)
    bytes: Optional[int]  # None where the trace gives no size or an unknown dtype
    duration_us: float
    algbw_gbps: Optional[float]
    busbw_gbps: Optional[float]
    kind: str  # GRADIENT or OTHER_COLLECTIVE
    group_size: Optional[int]
    phase: Optional[str]
    bucket: Optional[int]
    start_us: float


@dataclass(frozen=True)
class PlacedOp:
    """A GPU op with the step and phase that queued it (None outside every step; no phase without phase ranges)."""

    op: GpuOp
    step: Optional[int]
    phase: Optional[str]


@dataclass(frozen=True)
class StepAnalysis:
    step: int
    counted: bool  # in the rank's totals (the last of two or more steps is not)
    breakdown: Breakdown
    phases: dict[str, Breakdown]
    exposed_comm_us: Optional[float]  # None without a backward phase


@dataclass(frozen=True)
class RankAnalysis:
    path: Path
    rank: int
    world_size: Optional[int]
    total: Breakdown  # over the counted steps' ops (and those queued before the first step)
    phases: dict[str, Breakdown]  # summed over the counted steps
    steps: tuple[StepAnalysis, ...]
    collectives: tuple[Collective, ...]
    ops: tuple[PlacedOp, ...] = field(repr=False, default=())  # every op, for pictures


def load(path: str | Path) -> Trace:
    """Reads one trace file (JSON, gzipped or not); raises ``TraceError`` for anything that is not a trace."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, EOFError, ValueError) as err:  # unreadable, bad gzip, not JSON (UnicodeError included)
        raise TraceError(f"{path}: not a trace file ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path}: not a trace file (JSON without 'traceEvents')")
    rank, world_size = _rank_of(path, data.get("distributedInfo"))
    try:
        return Trace(path, rank, world_size, *_parse(data["traceEvents"]))
    except (KeyError, TypeError, ValueError) as err:
        raise TraceError(f"{path}: a malformed trace event ({type(err).__name__}: {err})") from None


def _rank_of(path: Path, info: Any) -> tuple[int, Optional[int]]:
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        world_size = info.get("world_size")
        return info["rank"], world_size if isinstance(world_size, int) else None
    found = _RANK_IN_NAME.search(path.name)
    if found is None:
        raise TraceError(f"{path}: cannot tell its rank: no distributedInfo in the trace and no 'rank<N>' in "
                         "its name")  # fmt: skip
    return int(found.group(1) or found.group(2)), None


def _parse(events: list) -> tuple[tuple[GpuOp, ...], tuple[Range, ...], tuple[MemoryEvent, ...]]:
    launches = {}
    # An event without a category: "" is none of the categories below.
    for e in events:
        if isinstance(e, dict) and str(e.get("cat", "")).lower() in _LAUNCH_CATS:
            launches[(e.get("args") or {}).get("correlation")] = float(e["ts"])
    ops, ranges, memory = [], [], []
    for e in events:
        if isinstance(e, dict) and e.get("name") == "[memory]" and e.get("ph") == "i":
            args = e.get("args") or {}
            memory.append(MemoryEvent(float(e["ts"]), int(args["Bytes"]), int(args.get("Device Type", CPU_DEVICE))))
            continue
        if not isinstance(e, dict) or e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name, start = str(e.get("cat", "")).lower(), str(e.get("name", "")), float(e["ts"])
        end = start + float(e["dur"])
        args = e.get("args") or {}
        if cat in _GPU_CATS:
            nccl = _NCCL.match(name) is not None or "Collective name" in args
            kind = "communication" if nccl else "compute" if _GPU_CATS[cat] == "kernel" else "memory"
            ops.append(GpuOp(name, kind, int(args.get("stream", e.get("tid", -1))), start, end,
                             launches.get(args.get("correlation")), args))  # fmt: skip
        elif cat in _RANGE_CATS and (_STEP.fullmatch(name) or _BUCKET.fullmatch(name) or phase_table.read_as(name)):
            ranges.append(Range(name, start, end))
    ops.sort(key=lambda op: op.start_us)
    ranges.sort(key=lambda r: r.start_us)
    memory.sort(key=lambda m: m.ts_us)
    return tuple(ops), tuple(ranges), tuple(memory)


def breakdown(ops: Sequence[GpuOp], kernel_wait_us: float = KERNEL_WAIT_US) -> Optional[Breakdown]:
    """The module docstring's figures for ``ops``; None when there are none."""
    if not ops:
        return None
    busy = merge((op.start_us, op.end_us) for op in ops)
    compute = merge((op.start_us, op.end_us) for op in ops if op.kind == "compute")
    comm = merge((op.start_us, op.end_us) for op in ops if op.kind == "communication")
    waits = {"host_wait_us": 0.0, "kernel_wait_us": 0.0, "other_wait_us": 0.0}  # the Breakdown's fields
    by_start = sorted(ops, key=lambda op: op.start_us)
    starts = [op.start_us for op in by_start]
    for before, after in zip(busy, busy[1:], strict=False):
        gap = after.start - before.end
        first = by_start[bisect_right(starts, after.start) - 1]  # an op that starts the busy stretch
        late = first.launch_us is not None and first.launch_us > before.end
        waits["host_wait_us" if late else "kernel_wait_us" if gap < kernel_wait_us else "other_wait_us"] += gap
    span = busy[-1].end - busy[0].start
    comm_us = length(comm)
    overlap = length(compute) + comm_us - length(merge([*compute, *comm]))  # both at once
    return Breakdown(span, length(busy), span - length(busy), length(compute), length(busy) - length(compute),
                     comm_us, overlap, 100 * overlap / comm_us if comm_us else None, **waits)  # fmt: skip


def combine(parts: Iterable[Breakdown]) -> Optional[Breakdown]:
    """Breakdowns of disjoint sets of ops added up (the overlap share recomputed); None for none."""
    parts = list(parts)
    if not parts:
        return None
    sums = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(Breakdown) if f.name.endswith("_us")}
    comm = sums["communication_us"]
    return Breakdown(**sums, comm_comp_overlap_pct=100 * sums["overlap_us"] / comm if comm else None)


class _Lookup:
    """The ranges of one kind that hold a time; the innermost is the latest to start."""

    def __init__(self, ranges: Iterable[Range]) -> None:
        self.ranges = sorted(ranges, key=lambda r: r.start_us)
        self._starts = [r.start_us for r in self.ranges]

    def innermost(self, t: float) -> Optional[Range]:
        for r in reversed(self.ranges[: bisect_right(self._starts, t)]):
            if t <= r.end_us:
                return r
        return None


def analyze_rank(trace: Trace, kernel_wait_us: float = KERNEL_WAIT_US) -> RankAnalysis:
    """Totals, steps, phases and collectives of one rank's trace; raises ``NoGpuEvents`` for a CPU-only one."""
    if not kernel_wait_us >= 0:
        raise ValueError(f"`analyze_rank(kernel_wait_us={kernel_wait_us!r})` must be >= 0")
    if not trace.ops:
        raise NoGpuEvents(f"{trace.path}: the trace has no GPU events (kernels, memcpy, memset): a CPU-only profile")
    step_ranges = [r for r in trace.ranges if _STEP.fullmatch(r.name)]
    own = [r for r in step_ranges if r.name.startswith(STEP_PREFIX)]
    steps = _Lookup(own or step_ranges)  # the tool's own steps where it marked them
    phases = _Lookup(r for r in trace.ranges if phase_table.read_as(r.name))
    buckets = _Lookup(r for r in trace.ranges if _BUCKET.fullmatch(r.name))
    has_phases = bool(phases.ranges)

    placed = []
    for op in trace.ops:
        step, phase = steps.innermost(op.queued_us), phases.innermost(op.queued_us)
        number = None if step is None else int(_STEP.fullmatch(step.name).group(2))
        named = phase_table.read_as(phase.name) if phase else phase_table.REMAINDER if has_phases and step else None
        placed.append(PlacedOp(op, number, named))
    numbers = sorted({int(_STEP.fullmatch(r.name).group(2)) for r in steps.ranges})
    last = steps.ranges[-1].start_us if len(numbers) > 1 else math.inf
    collectives = tuple(_collective(p, buckets, has_phases, trace.world_size) for p in placed
                        if p.op.kind == "communication")  # fmt: skip
    per_step = []
    for number in numbers:
        mine = [p for p in placed if p.step == number]
        if mine:
            names = phase_table.names()
            by_phase = {ph: breakdown([p.op for p in mine if p.phase == ph], kernel_wait_us) for ph in names}
            gradients = [c for c in collectives if c.step == number and c.kind == GRADIENT]
            per_step.append(StepAnalysis(number, number != numbers[-1] or len(numbers) == 1,
                                         breakdown([p.op for p in mine], kernel_wait_us),
                                         {ph: b for ph, b in by_phase.items() if b is not None},
                                         _exposed(mine, gradients)))  # fmt: skip
    summed = {ph: combine(s.phases[ph] for s in per_step if s.counted and ph in s.phases) for ph in phase_table.names()}
    return RankAnalysis(trace.path, trace.rank, trace.world_size,
                        breakdown([op for op in trace.ops if op.queued_us < last], kernel_wait_us),
                        {ph: b for ph, b in summed.items() if b is not None}, tuple(per_step), collectives,
                        tuple(placed))  # fmt: skip


def _exposed(placed: list[PlacedOp], gradients: list[Collective]) -> Optional[float]:
    ends = [p.op.end_us for p in placed if p.phase == phase_table.ALL_REDUCING and p.op.kind == "compute"]
    if not ends:
        return None
    tails = [(max(c.start_us, max(ends)), c.start_us + c.duration_us) for c in gradients]
    return union_length(tails)


def collective_name(op: GpuOp) -> str:
    """nccl-tests' name of a NCCL kernel's collective: from its ``Collective name`` argument, else its name."""
    raw = op.args.get("Collective name")
    if raw is None:
        found = _NCCL_OP.match(op.name)
        raw = re.sub(r"(?<!^)(?=[A-Z])", "_", found.group(1)) if found else op.name
    key = str(raw).lower().strip("_")  # strip("XX_XX") is equivalent: no "X" is left once lowered
    for suffix in ("_coalesced", "_base", "_tensor", "_into"):  # allgather_into_tensor_coalesced, _allgather_base
        key = key.removesuffix(suffix)
    plain = {k.replace("_", ""): k for k in ("all_reduce", *RING_ONCE, *DIRECT)}
    # The names torch writes, and the kernels' split at their capitals, hold underscores only where nccl-tests' name
    # has them (reduce_scatter) or none (allgather): a key with underscores is its own plain name, found or not.
    return plain.get(key.replace("_", ""), key)


def _collective(placed: PlacedOp, buckets: _Lookup, has_phases: bool, world_size: Optional[int]) -> Collective:
    op, step, phase = placed.op, placed.step, placed.phase
    name = collective_name(op)
    elements = max((op.args.get(k) for k in ("In msg nelems", "Out msg nelems") if isinstance(op.args.get(k), int)),
                   default=None)  # fmt: skip
    size = DTYPE_BYTES.get(str(op.args.get("dtype")))
    nbytes = elements * size if elements is not None and size is not None else None
    duration = op.end_us - op.start_us
    algbw = nbytes / duration / 1e3 if nbytes is not None and duration > 0 else None  # bytes/us -> GB/s
    group = op.args.get("Group size") if isinstance(op.args.get("Group size"), int) else world_size
    factor = bus_factor(name, group) if group else None
    busbw = algbw * factor if algbw is not None and factor is not None else None
    bucket = buckets.innermost(op.queued_us)
    number = int(_BUCKET.fullmatch(bucket.name).group(1)) if bucket else None
    gradient = name == "all_reduce" and (
        bucket or phase == phase_table.ALL_REDUCING or (not has_phases and step is not None)
    )
    kind = GRADIENT if gradient else OTHER_COLLECTIVE
    return Collective(step, name, nbytes, duration, algbw, busbw, kind, group, phase, number, op.start_us)
