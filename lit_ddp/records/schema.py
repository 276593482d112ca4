"""The record of a run, defined once: what the callbacks write into the run's log dir and what the report, the
forecast, the benchmarks, the notebook and the tests read back, by field name.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2   # writes phases.json, comm.json
    python -m lit_ddp.report runs/mini_train_profile/version_0                   # reads them

``phases.json`` is a ``PhaseRecord`` (PhaseTimer), ``comm.json`` a ``CommRecord`` (CommMonitor); both carry
``schema`` (``SCHEMA_VERSION``) and a ``RunMeta``; a rank that ran out of memory writes ``oom_rank<r>.json``
(an ``OutOfMemory``). Times are milliseconds, memory bytes. Which steps are steady and which a rank
keeps: ``lit_ddp.records.steps``. The fields, what a step is, and
the window: docs/architecture.md.
"""

import dataclasses
import functools
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

from lit_ddp.errors import RecordError
from lit_ddp.records.phases import StepPhases
from lit_ddp.records.sketch import Sketch
from lit_ddp.records.steps import is_steady

R = TypeVar("R")
# 3: memory (StepMemory, DDPMemory, OutOfMemory); 4: each kept step's start (StepRow.start_s); 5: a step's
# boundaries keyed by name (StepRow.offsets_ms), so that a phase more (lit_ddp.records.phases) is no new schema.
SCHEMA_VERSION = 5
# Schemas this lit_ddp reads: 3 is 4 without the steps' starts and the ending (they load as None); 3 and 4 hold the
# boundaries as a list, in OLD_BOUNDARIES' order.
READS = (3, 4, SCHEMA_VERSION)
OLD_BOUNDARIES = ("forward_start", "forward_end", "backward_start", "backward_end", "update_start", "update_end",
                  "data_start", "end")  # fmt: skip
MAX_SKIPPED_KEPT = 100  # skipped steps named in a record (all are counted)


@dataclass
class RunMeta:
    """What the run was: where it ran and with what; ``clock`` names what the times mean."""

    world_size: int
    device: str
    device_name: str
    backend: str
    clock: str
    precision: str
    torch: str
    lightning: str


@dataclass
class StepRow:
    """One kept step of one rank: its phases and where each boundary fell (ms from the step's start, by the
    boundary's name: ``lit_ddp.records.phases.boundaries()``)."""

    step: int
    ms: StepPhases
    offsets_ms: dict[str, float]
    micro_batches: int = 1  # batches (forward + backward) in this optimizer step: gradient accumulation
    # The step's start on this rank's host clock (seconds; lit_ddp.measure.clock.host_now's, the clock of
    # StepBuckets.arrival_s; on CUDA when the GPU reached it). Minus comm.json's clock_offset_s[rank]: on rank 0's
    # clock (docs/traces.md). None in a schema-3 record.
    start_s: Optional[float] = None


@dataclass
class StepMemory:
    """One step's memory on one rank, in bytes: held when it started, and per phase (``lit_ddp.records.phases``;
    ``step`` is the whole step) the most held at once and what was still held when the phase ended (its last span,
    with gradient accumulation). ``PhaseRecord.memory_source`` says whose bytes they are
    (``lit_ddp.measure.memory``)."""

    step: int
    start: int
    peak: dict[str, int]
    retained: dict[str, int]


@dataclass
class DDPMemory:
    """What DDP training holds on one rank, exactly, from the live objects: the parameters, their gradients (one
    tensor each, or views into DDP's buckets under ``gradient_as_bucket_view``), DDP's gradient buckets (bytes
    per bucket, in the parameters' dtype, the final layout) and the optimizer's state."""

    parameters: int
    gradients: int  # the trainable parameters' gradients, allocated or not
    buckets: list[int]
    gradient_as_bucket_view: bool
    optimizer_state: int
    bucket_cap: int  # DDP's bucket_bytes_cap (0: not a DDP model)
    compression: Optional[str] = None  # the comm hook's cast for the all-reduce (fp16, bf16)

    @property
    def own_gradients(self) -> int:
        """Gradient bytes of their own: none under ``gradient_as_bucket_view`` (they are the buckets)."""
        return 0 if self.gradient_as_bucket_view and self.buckets else self.gradients

    @property
    def held(self) -> int:
        """Parameters, gradients, buckets and optimizer state: what a step starts with, at most."""
        return self.parameters + self.own_gradients + sum(self.buckets) + self.optimizer_state


@dataclass
class CollectiveCall:
    """One collective of one rank in a kept step, from torch's Flight Recorder (``lit_ddp.measure.collectives``): its
    sequence number (the same call has the same number on every rank), op, input shapes and dtype, the step and
    phase it was called in (a DDP gradient bucket's index), and when it was called, on the rank's host clock (the
    clock of ``StepRow.start_s``)."""

    seq: int
    op: str
    sizes: list[list[int]]
    dtype: str
    step: int
    phase: str
    at_s: float
    bucket: Optional[int] = None


@dataclass
class NamedWait:
    """A line the watchdog said on this rank during the fit (``lit_ddp.run.watchdog``: a wait named, a wait that
    moved on), the step it was in, and when, on the rank's host clock (the clock of ``StepRow.start_s``)."""

    step: Optional[int]
    at_s: float
    line: str


@dataclass
class RankPhases:
    """One rank's phases: the kept steps, the GPU-busy time of the profiled steps, and a ``Sketch`` per phase
    over every steady step."""

    rank: int
    rows: list[StepRow]
    summaries: dict[str, Sketch]
    busy_ms: list[StepRow] = field(default_factory=list)  # profiled steps; offsets_ms unused (empty)
    # Work inside fit that is no training step's, kept out of the phases: "validation" -> one value per run (ms).
    outside: dict[str, Sketch] = field(default_factory=dict)
    memory: list[StepMemory] = field(default_factory=list)  # the kept steps that have memory figures
    # Over the steps memory is summarised on: "start", "peak.<phase>", "retained.<phase>" (bytes).
    memory_summaries: dict[str, Sketch] = field(default_factory=dict)
    node: Optional[int] = None  # where the rank ran: its node rank, host name and device (None before schema 4)
    host: Optional[str] = None
    device: Optional[str] = None
    collectives: list[CollectiveCall] = field(default_factory=list)  # in the kept steps, where torch recorded them
    waits: list[NamedWait] = field(default_factory=list)  # what the watchdog said on this rank while the fit went on

    def row(self, step: int) -> Optional[StepRow]:
        return next((r for r in self.rows if r.step == step), None)


@dataclass
class Roofline:
    """The work of one optimizer step on one rank (all its micro-batches), and the device's peaks (None where
    unknown) for the dtype the matmuls run in (``compute_dtype``: the precision's, e.g. bfloat16 under
    ``bf16-mixed``)."""

    rows_per_rank: int
    forward_flop: float
    backward_flop: float
    update_bytes: float
    peak_tflops: Optional[float] = None
    peak_gbps: Optional[float] = None
    peak_label: Optional[str] = None
    micro_batches: int = 1
    compute_dtype: Optional[str] = None
    # Where the FLOPs come from: "FlopCounterMode, step <n>" (the fit's first step, counted as Lightning ran it), or
    # None (not counted: PhaseTimer(count_flops=False), or the step never ended).
    flop_source: Optional[str] = None


@dataclass
class PhaseRecord:
    """``phases.json``: PhaseTimer's record of every rank."""

    meta: RunMeta
    ranks: list[RankPhases]
    profiled_steps: list[int] = field(default_factory=list)
    roofline: Optional[Roofline] = None
    kind: str = "phases"
    skipped_steps: list[int] = field(default_factory=list)  # the first MAX_SKIPPED_KEPT the grad scaler skipped
    skipped_count: int = 0  # all of them
    # Whose bytes RankPhases.memory holds: "cuda_allocator" (every step), "cpu_profiler" (profiled steps), or None.
    memory_source: Optional[str] = None
    # The global step the fit started from: 0, or the resume point of a fit resumed from a checkpoint. Steps are
    # global step numbers; the fit's warm-up step is this one, and its profiled steps come after it.
    first_step: int = 0
    ended_by: Optional[str] = None  # "SIGTERM": the fit stopped at its last step on a SIGTERM (StepSync)

    @property
    def steps(self) -> list[int]:
        """The steps whose detail rank 0 kept."""
        return [r.step for r in self.ranks[0].rows]

    def steady_rows(self, rank: int = 0) -> list[StepRow]:
        left_out = {*self.profiled_steps, *self.skipped_steps}
        return [r for r in self.ranks[rank].rows if is_steady(r.step, left_out, self.first_step)]


@dataclass
class StepBuckets:
    """One kept step of one rank's gradient all-reduce: per bucket (in index order) its bytes, its time, and its
    ready time (ms from backward's start to the hand-over to the comm hook); per step the time communication
    was busy and how much of it was exposed."""

    step: int
    bytes: list[int]
    ms: list[float]
    ready_ms: list[float]
    busy_ms: float
    exposed_ms: float
    arrival_s: list[float] = field(default_factory=list)  # each hand-over on this rank's host clock (seconds)
    micro_batches: int = 1  # backward passes in this optimizer step (gradient accumulation)
    synced: list[int] = field(default_factory=lambda: [0])  # the micro-batches whose backward handed buckets over


@dataclass
class RankComm:
    """One rank's buckets: the kept steps, and over the steady steps with the final layout a ``Sketch`` per
    ``bucket<i>.ms``, ``bucket<i>.ready_ms``, ``busy_ms``, ``exposed_ms`` and ``total_ms``."""

    rank: int
    rows: list[StepBuckets]
    summaries: dict[str, Sketch]


@dataclass
class CommRecord:
    """``comm.json``: CommMonitor's record of every rank; ``layout`` is DDP's final bucket layout (bytes)."""

    meta: RunMeta
    ranks: list[RankComm]
    layout: list[int]
    param_bytes: int
    compression: Optional[str] = None
    first_layout: list[int] = field(default_factory=list)  # the layout DDP built the model with (step 0's)
    profiled_steps: list[int] = field(default_factory=list)
    clock_offset_s: list[float] = field(default_factory=list)  # each rank's host clock minus rank 0's
    clock_error_s: list[float] = field(default_factory=list)  # ... within this, either way
    find_unused_parameters: bool = False
    unused: list[str] = field(default_factory=list)  # rank 0's parameters without a gradient in its last step
    unused_bytes: int = 0
    unused_every_step: bool = False  # the same ones in every step rank 0 ran
    straggler: Optional[dict[str, Any]] = None  # lit_ddp.derive.stragglers.Straggler's fields, with phases.json's cause
    kind: str = "comm"
    wire_dtype: Optional[str] = None  # the buckets' dtype as the all-reduce saw them (after any compression)
    ddp_memory: Optional[DDPMemory] = None  # rank 0's, at the end of training


@dataclass
class OutOfMemory:
    """``oom_rank<r>.json``: what a rank held when it ran out of memory, written by that rank before the job ends
    (the others may be waiting in a collective: no gather)."""

    meta: RunMeta
    rank: int
    step: int
    phase: str  # the phase running when the allocation failed
    error: str  # the exception's first line
    held: DDPMemory  # what the training state held then
    allocated: Optional[int] = None  # CUDA: every tensor's bytes then (the allocator's); None on CPU
    peak: Optional[int] = None  # the most held at once in a measured step before, and where
    peak_step: Optional[int] = None
    peak_phase: Optional[str] = None
    memory: list[StepMemory] = field(default_factory=list)
    memory_source: Optional[str] = None
    snapshot: Optional[str] = None  # torch.cuda.memory's snapshot file (PhaseTimer(memory_snapshot=True))
    kind: str = "oom"


def as_json(value: Any) -> Any:
    """A record, or any part of one, as plain JSON values by field name."""
    if isinstance(value, Sketch):
        return value.to_json()
    if dataclasses.is_dataclass(value):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (dict, StepPhases)):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


def save(record: PhaseRecord | CommRecord | OutOfMemory, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": SCHEMA_VERSION, **as_json(record)}))
    return path


def read(cls: type[R], data: Any, where: str = "") -> R:
    """A record, or any part of one, from its JSON by field name: the reader of ``as_json``'s output, derived from
    ``cls``'s own fields and their types. A field the data lacks takes its default (a field added within a schema
    loads from a record written before it); a missing field without a default, or data that is no object, is a
    ``RecordError`` that names where. Keys the fields do not name are passed over.

    Raises:
        RecordError: A required field is missing, or the data is not shaped as ``cls``.
    """
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected an object of {cls.__name__}'s fields, got {type(data).__name__}")
    hints = _hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in data:
            found[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecordError(f"{where}: no {f.name!r}, a required field of {cls.__name__}")
    return cls(**found)


def _value(kind: Any, data: Any, where: str) -> Any:
    """``data`` read as the annotation ``kind`` says: a dataclass, a Sketch, a list or dict of them, Optional."""
    if kind is Sketch:
        return Sketch.from_json(data)
    if kind is StepPhases:
        return StepPhases(data)
    if dataclasses.is_dataclass(kind):
        return read(kind, data, where)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if data is None:
            return None
        kinds = [a for a in args if a is not type(None)]
        return _value(kinds[0], data, where) if len(kinds) == 1 else data
    if origin is list and isinstance(data, list):
        return [_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(data)]
    if origin is dict and isinstance(data, dict):
        return {key: _value(args[1], item, f"{where}[{key!r}]") for key, item in data.items()}
    if origin in (list, dict):
        raise RecordError(f"{where}: expected a {origin.__name__}, got {type(data).__name__}")
    return data


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def load(path: Path) -> PhaseRecord | CommRecord | OutOfMemory:
    """Reads a record written by any version of the tool: this schema loads, any other is refused in one line.

    Raises:
        RecordError: Not a record, or one of another schema version.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RecordError(f"{path}: not a readable run record: {err}") from err
    version = data.get("schema", 1) if isinstance(data, dict) else None
    if version not in READS:
        raise RecordError(f"{path}: run record schema {version}; this lit_ddp reads schema {READS[0]} to "
                          f"{SCHEMA_VERSION} (written by another version of the tool: run the job again)")  # fmt: skip
    kinds = {"phases": PhaseRecord, "comm": CommRecord, "oom": OutOfMemory}
    kind = kinds.get(data.get("kind"))
    try:
        if kind is None:
            raise RecordError(f"kind {data.get('kind')!r} is none of {sorted(kinds)}")
        if version < 5 and kind is PhaseRecord:
            _name_boundaries(data)
        found = read(kind, data)
        if not isinstance(found, OutOfMemory) and not found.ranks:  # a callback writes every rank's, or none
            raise RecordError(f"{kind.__name__}.ranks: no rank")
        return found
    except (RecordError, KeyError, TypeError, ValueError) as err:
        raise RecordError(f"{path}: a damaged run record ({err})") from err


def _name_boundaries(data: dict) -> None:
    """A schema 3 or 4 ``phases.json``'s boundaries, lists in ``OLD_BOUNDARIES`` order, keyed by name as schema
    5's (in place, before it is read)."""
    for rank in data.get("ranks") or ():
        for row in (*(rank.get("rows") or ()), *(rank.get("busy_ms") or ())):
            if isinstance(row, dict) and isinstance(row.get("offsets_ms"), list):
                row["offsets_ms"] = dict(zip(OLD_BOUNDARIES, row["offsets_ms"], strict=False))


def load_run(run_dir: Union[str, os.PathLike]) -> tuple[Optional[PhaseRecord], Optional[CommRecord]]:
    """The run's ``phases.json`` and ``comm.json`` (``run_dir`` a path or a str, as ``trainer.log_dir``); None for a
    file the run did not write."""
    run_dir = Path(run_dir)
    found = [load(run_dir / name) if (run_dir / name).is_file() else None for name in ("phases.json", "comm.json")]
    return found[0], found[1]  # type: ignore[return-value]


def load_oom(run_dir: Union[str, os.PathLike]) -> list[OutOfMemory]:
    """The run's ``oom_rank<r>.json`` records, in rank order (none when no rank ran out of memory)."""
    found = [load(path) for path in Path(run_dir).glob("oom_rank*.json")]
    return sorted((r for r in found if isinstance(r, OutOfMemory)), key=lambda r: r.rank)
