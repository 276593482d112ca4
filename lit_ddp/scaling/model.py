"""The forecast's model of one DDP step at N ranks, from one measured run: the measured inputs (``Measured``,
read by ``measured_run``), the simulation of the buckets' all-reduces (``simulate``) and DDP's knobs as what-ifs.

    python -m lit_ddp.forecast runs/mini_train_profile/version_0 --forecast 8,64,512

The model, its equations and what it leaves out: docs/forecast.md.
"""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from lit_ddp.derive.summaries import comm_summary, micro_batches, phase_summary
from lit_ddp.errors import ForecastError, RecordError
from lit_ddp.formatting import fmt_bytes
from lit_ddp.records import phases as phase_table
from lit_ddp.records.schema import CommRecord, DDPMemory, PhaseRecord, StepRow
from lit_ddp.records.schema import load_run as load_record
from lit_ddp.scaling.links import Topology, allreduce_ms

MIB = 1024**2
# The phases the model's step is built of; it takes every other as one.
MODELLED = (phase_table.FORWARD, phase_table.ALL_REDUCING, phase_table.UPDATE)


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: its bytes on the wire and when it was handed to the comm hook."""

    nbytes: float
    ready_ms: float


@dataclass(frozen=True)
class Measured:
    """A run's steady-state step, per rank compute at the slowest rank's pace."""

    forward_ms: float
    update_ms: float
    other_ms: float
    tail_ms: float
    buckets: tuple[Bucket, ...]
    world_size: int
    rows_per_rank: int | None
    compression: str | None
    backward_ms: float  # as measured, for the report
    exposed_ms: float  # as measured
    comm_ms: float  # as measured: sum of the bucket all-reduce times
    step_ms: float  # as measured
    n_steps: int
    backward_before_ms: float = 0.0  # the backward of the micro-batches before the last (under no_sync)
    micro_batches: int = 1
    device: str = "cuda"  # where the compute was measured ("cpu": a CPU's times, whatever links are assumed)
    device_name: str = ""
    held: Optional[DDPMemory] = None  # what rank 0's DDP training held (CommMonitor's DDPMemory)


@dataclass(frozen=True)
class Forecast:
    """The model's step at ``ranks`` ranks."""

    ranks: int
    step_ms: float
    backward_ms: float
    exposed_ms: float  # from the end of backward's compute to the end of the last all-reduce
    comm_ms: float  # sum of the all-reduce times: busy, hidden or not


def simulate(run: Measured, ranks: int, topo: Topology, buckets: Sequence[Bucket] | None = None) -> Forecast:
    """The step at ``ranks`` ranks; ``buckets`` replaces the measured ones for what-ifs."""
    buckets = run.buckets if buckets is None else buckets
    end = ready = comm = 0.0
    ends = []
    for bucket in buckets:
        ready = max(ready, bucket.ready_ms)  # launched in index order: never before an earlier bucket
        cost = allreduce_ms(bucket.nbytes, ranks, topo)
        end = max(ready, end) + cost
        ends.append(end)
        comm += cost
    # DDP's finalize: wait for each bucket's all-reduce in turn, then copy its result into .grad.
    backward, total = ready, sum(b.nbytes for b in buckets)
    for bucket, bucket_end in zip(buckets, ends, strict=True):  # one end a bucket: strict= alike
        backward = max(backward, bucket_end) + run.tail_ms * bucket.nbytes / total
    step = run.forward_ms + run.backward_before_ms + backward + run.update_ms + run.other_ms
    return Forecast(ranks, step, run.backward_before_ms + backward, exposed_ms=end - ready, comm_ms=comm)


def rebucket(buckets: Sequence[Bucket], cap_bytes: float) -> tuple[Bucket, ...]:
    """Merges consecutive measured buckets the way DDP fills its buckets: one closes once it holds
    ``cap_bytes`` or more. A merged bucket is ready when its last gradient is. Measured buckets are the finest
    grain the run recorded, so a cap below their size leaves them as they are."""
    merged: list[Bucket] = []
    nbytes, ready = 0.0, 0.0
    for bucket in buckets:
        nbytes, ready = nbytes + bucket.nbytes, max(ready, bucket.ready_ms)
        if nbytes >= cap_bytes:
            merged.append(Bucket(nbytes, ready))
            nbytes = 0.0
    if nbytes:
        merged.append(Bucket(nbytes, ready))
    return tuple(merged)


def measured_run(run_dir: Path) -> Measured:
    """Reads the run's ``phases.json`` and ``comm.json`` (``lit_ddp.records.schema``) into the model's inputs
    (``measured``): for a run read from disk, as the forecast's tests and benchmarks do."""
    try:
        phases, comm = load_record(run_dir)
    except RecordError as err:
        raise ForecastError(str(err)) from err
    return measured(phases, comm, str(run_dir))


def measured(phases: Optional[PhaseRecord], comm: Optional[CommRecord], where: str = "the run") -> Measured:
    """A run's records, in memory, as the model's inputs: per rank the steady medians (see the module docstring),
    then the slowest rank. ``where`` names the run in the errors."""
    for name, found in (("phases.json", phases), ("comm.json", comm)):
        if found is None:
            raise ForecastError(f"no {name} in {where}: the forecast needs a run with PhaseTimer and CommMonitor")
    if phases.meta.world_size != comm.meta.world_size:
        raise ForecastError(f"phases.json has world_size {phases.meta.world_size}, comm.json {comm.meta.world_size}")
    if not comm_summary(comm, 0, "total_ms").count:
        raise ForecastError(f"{where}: no step with DDP's final bucket layout: run more steps")
    per_rank = []
    micro = micro_batches(phases)
    for r in range(comm.meta.world_size):
        med = {p: phase_summary(phases, r, p).median for p in phase_table.with_step()}
        # The model's own phases are forward, backward (the all-reducing one) and update; it takes every other as one.
        med["outside"] = sum(med[p] for p in phase_table.names() if p not in MODELLED)
        for name in ("exposed_ms", "total_ms"):
            med[name] = comm_summary(comm, r, name).median
        med["ready"] = [comm_summary(comm, r, f"bucket{b}.ready_ms").median for b in range(len(comm.layout))]
        # With accumulation only the last micro-batch's backward all-reduces (the others are compute).
        backward = med[phase_table.ALL_REDUCING]
        last = phase_summary(phases, r, phase_table.BACKWARD_LAST).median if micro > 1 else backward
        med["backward_before"] = max(0.0, backward - last)
        # The tail joins the two records step by step: over the steady steps both kept.
        kept = {row.step: row for row in phases.steady_rows(r)}
        tails = [_last_backward(kept[b.step]) - max(b.ready_ms) - b.exposed_ms
                 for b in comm.ranks[r].rows if b.step in kept and b.bytes == comm.layout]  # fmt: skip
        med["tail"] = statistics.median(tails) if tails else 0.0
        per_rank.append(med)

    def slowest(key: str) -> float:  # every all-reduce waits for the slowest rank
        return max(m[key] for m in per_rank)

    buckets = tuple(Bucket(nbytes, max(m["ready"][b] for m in per_rank)) for b, nbytes in enumerate(comm.layout))
    return Measured(
        forward_ms=slowest(phase_table.FORWARD), update_ms=slowest(phase_table.UPDATE), other_ms=slowest("outside"),
        tail_ms=max(0.0, slowest("tail")), buckets=buckets, world_size=comm.meta.world_size,
        rows_per_rank=phases.roofline.rows_per_rank if phases.roofline else None, compression=comm.compression,
        backward_ms=slowest(phase_table.ALL_REDUCING), exposed_ms=slowest("exposed_ms"), comm_ms=slowest("total_ms"),
        step_ms=slowest("step"), n_steps=comm_summary(comm, 0, "total_ms").count,
        backward_before_ms=slowest("backward_before"), micro_batches=micro, device=phases.meta.device,
        device_name=phases.meta.device_name, held=comm.ddp_memory,
    )  # fmt: skip


def _last_backward(row: StepRow) -> float:  # the backward DDP all-reduces after: the last micro-batch's
    return row.ms.backward_last if row.micro_batches > 1 else row.ms.backward


def what_ifs(run: Measured, caps_mib: Sequence[float]) -> list[tuple[str, Measured, tuple[Bucket, ...]]]:
    """(label, run, buckets) for each knob whose effect the model can compute."""
    rows = [(f"as measured ({len(run.buckets)} buckets)", run, run.buckets)]
    for cap in caps_mib:
        merged = rebucket(run.buckets, cap * MIB)
        rows.append((f"bucket_cap_mb {cap:g} ({len(merged)} buckets)", run, merged))
    if run.compression is None:
        half = tuple(replace(b, nbytes=b.nbytes / 2) for b in run.buckets)
        rows.append(("fp16/bf16 compression (1/2 bytes)", run, half))
    else:
        double = tuple(replace(b, nbytes=b.nbytes * 2) for b in run.buckets)
        rows.append((f"no compression (2x the {run.compression} bytes)", run, double))
    # The gradients are the buckets: no copy back into .grad (and none into the bucket during backward, a saving
    # the run cannot separate from backward's compute, so not counted).
    label = "gradient_as_bucket_view (no copy-back)"
    if run.held is not None and not run.held.gradient_as_bucket_view and run.held.buckets:
        label = f"gradient_as_bucket_view (no copy-back; {fmt_bytes(sum(run.held.buckets))} less held per rank)"
    rows.append((label, replace(run, tail_ms=0.0), run.buckets))
    return rows
