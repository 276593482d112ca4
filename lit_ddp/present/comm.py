"""What a run's ``comm.json`` says: the all-reduce table (buckets, bytes, bandwidth, exposed time, the straggler),
as text; the callbacks print it at the end of training and ``python -m lit_ddp.report RUN`` again.

    python -m lit_ddp.report runs/mini_train_profile/version_0

How its figures are defined: docs/output.md.
"""

import math

from lit_ddp.analysis.run_analysis import RunAnalysis
from lit_ddp.derive import stragglers
from lit_ddp.derive.summaries import comm_summary
from lit_ddp.formatting import CLI, Advice, fmt_bandwidth, fmt_ms, table
from lit_ddp.maths.bus_factors import allreduce_bus_factor
from lit_ddp.present.bound import cpu_bound
from lit_ddp.present.memory import ddp_memory_lines
from lit_ddp.present.phases import DEFAULT_PRECISION
from lit_ddp.records.schema import CommRecord


def comm_table(analysis: RunAnalysis, advice: Advice = CLI, detail: bool = True) -> str:
    """Per bucket: bytes, all-reduce time, algbw and busbw (nccl-tests definitions); per step: totals; on
    several ranks, the straggler verdict (``lit_ddp.derive.stragglers``), with the phase record naming its slow phase;
    the knobs phrased for where the table is read (``advice``).

    Buckets are those of the final layout (DDP rebuilds its buckets after the first step), timed over the
    steady steps that used it. With several ranks, a bucket's time is its transfer (the shortest duration across
    ranks: the last rank to arrive waits for no one), shown beside the longest wait for the last arrival, so
    that a straggler does not pass for a slow link.

    Without ``detail``, only the lines that change the answer: no ring formula and no bucket_cap note, and the
    compression what-if only where the all-reduce bounds the step (``lit_ddp.present.bound``).
    """
    record, phases, found = analysis.comm, analysis.phases, analysis.straggler
    n = record.meta.world_size
    ring = allreduce_bus_factor(n)
    rows = []
    for b, nbytes in enumerate(record.layout):
        t = found.transfer_per_bucket_ms[b] if found else comm_summary(record, 0, f"bucket{b}.ms").median
        algbw = nbytes / (t / 1e3) / 1e9 if t > 0 else math.nan
        row = (b, f"{nbytes:,}", fmt_ms(t), fmt_bandwidth(algbw), fmt_bandwidth(algbw * ring))
        rows.append((*row, fmt_ms(found.wait_per_bucket_ms[b])) if found else row)
    header = ("bucket", "bytes", "transfer" if found else "time", "algbw", "busbw", *(("wait",) if found else ()))
    total = sum(record.layout)
    exposed = comm_summary(record, 0, "exposed_ms").median
    busy = comm_summary(record, 0, "busy_ms").median
    first = record.first_layout
    rebuilt = f" (step 0 ran on DDP's initial {len(first)} bucket(s))" if first and first != record.layout else ""
    plain = record.meta.precision == DEFAULT_PRECISION and record.wire_dtype in (None, "float32")
    wire = f"{record.wire_dtype} on the wire, " if record.wire_dtype and not plain else ""
    return (
        f"Gradient all-reduce per step ({n} ranks, {wire}compression {record.compression or 'none'}, "
        f"{'all ranks' if found else 'rank 0'}, steady median):\n"
        + table(header, rows)
        + f"\n{len(record.layout)} bucket(s){rebuilt}, {total:,} bytes reduced per step "
        f"({record.param_bytes:,} bytes of gradients)"
        + (f"; each rank sends 2(n-1)/n x S = {ring * total:,.0f} bytes in a ring all-reduce" if detail else "")
        + f".\ncommunication {fmt_ms(busy)} per step, of which {fmt_ms(exposed)} exposed "
        f"(not hidden under backward compute)"
        + _precision_line(record)
        + _accumulation_line(record)
        + _unused_line(record)
        + (
            f"\n{ddp_memory_lines(record.ddp_memory, advice, detail, _comm_bound(analysis))}"
            if record.ddp_memory
            else ""
        )
        # A straggler is the phase table's verdict when there is one; otherwise it is said here.
        + (f"\n{stragglers.verdict_line(found)}" if found and (phases is None or found.rank is None) else "")
    )


def _comm_bound(analysis: RunAnalysis) -> bool:
    """Whether the all-reduce's exposed transfer bounds the step (the verdict's rule)."""
    bound = cpu_bound(analysis) if analysis.phases is not None and analysis.parts else None
    return bound is not None and bound.called and bound.first == "exposed"


def _precision_line(record: CommRecord) -> str:
    """Mixed precision computes in 16 bits but keeps fp32 parameters, hence fp32 gradients on the wire."""
    precision = record.meta.precision
    if "mixed" not in precision or record.wire_dtype != "float32":
        return ""
    return (f"\n{precision} runs the matmuls in 16 bits but keeps the parameters and their gradients in float32: "
            "the all-reduce moves float32 (CommMonitor(compression: bf16) would halve it)")  # fmt: skip


def _accumulation_line(record: CommRecord) -> str:
    """Gradient accumulation: which of the step's backward passes all-reduced (DDP's no_sync for the others)."""
    rows = record.ranks[0].rows
    if not rows or max(r.micro_batches for r in rows) <= 1:
        return ""
    last = rows[-1]
    n, synced = last.micro_batches, last.synced
    if synced == [n - 1]:
        return (f"\ngradient accumulation: {n} micro-batches per step; only the last one's backward all-reduced "
                f"(micro-batch {n - 1}), the other {n - 1} ran under DDP's no_sync: the bytes above move once "
                f"per {n} micro-batches")  # fmt: skip
    return (
        f"\ngradient accumulation: {n} micro-batches per step, and micro-batches {synced} all-reduced: "
        f"{len(synced)}x the bytes above per step (no no_sync)"
    )


def _unused_line(record: CommRecord) -> str:
    """What ``find_unused_parameters=True`` found, and what it costs."""
    if not record.find_unused_parameters:
        return ""
    if not record.unused:
        return ("\nfind_unused_parameters=True, and every parameter got a gradient: DDP's search of the autograd graph "
                "after every forward finds nothing; turn it off")  # fmt: skip
    names = ", ".join(record.unused[:5]) + (f" and {len(record.unused) - 5} more" if len(record.unused) > 5 else "")
    share = record.unused_bytes / record.param_bytes if record.param_bytes else 0.0
    when = "in every step" if record.unused_every_step else "in the last step (the set changes between steps)"
    fix = (
        "or static_graph=True, since the same ones are unused every step"
        if record.unused_every_step
        else "or keep find_unused_parameters=True (the set changes, so static_graph cannot replace it)"
    )
    return (f"\nfind_unused_parameters=True: {len(record.unused)} parameter(s), {record.unused_bytes:,} bytes "
            f"({share:.0%} of the gradients), got no gradient {when}: {names}. They are all-reduced all the same "
            f"(zeros, {share:.0%} of the bytes above), and DDP searches the autograd graph for them after every "
            f"forward: remove them, {fix}")  # fmt: skip
