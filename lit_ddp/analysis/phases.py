"""What a run's record says: the phase table, the roofline, the verdict and the all-reduce table, as text.

    python -m lit_ddp.report runs/mini_train_profile/version_0     # prints these from phases.json / comm.json

The callbacks print the same at the end of training. This module reads ``lit_ddp.records.schema`` types only and pulls
in no command line, so collection (the callbacks) may import it; ``lit_ddp.report`` is the CLI and the picture.
"""

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Optional

from lit_ddp.analysis import stragglers
from lit_ddp.analysis.tables import fmt_ms, fmt_si, table
from lit_ddp.records.schema import PHASES, CommRecord, PhaseRecord, StepPhases, StepRow, Summary

CLOCKS = {  # what each clock's times mean
    "perf_counter": ": host time",
    "cuda_event": ": device time between the marks, idle gaps included",
}

DEFAULT_PRECISION = "32-true"  # Lightning's default: the tables name any other, and the dtype on the wire

HINTS = {
    "forward": "a larger batch per rank or fewer, larger ops",
    "backward": "more overlap of the all-reduce with backward (smaller buckets; see the all-reduce table)",
    "update": "a fused or foreach optimizer (--model.fused true)",
    "data": "a faster input pipeline (DataLoader workers, pinned memory, prefetching)",
    "other": "less per-step Python: callbacks, logging, printing every step",
}


def format_step(step: int, phases: StepPhases) -> str:
    """The notes' per-step format (``mini_train_profile.py``), times in ms."""
    return (f"Step {step}\n forward : {phases.forward:.2f} ms\n backward: {phases.backward:.2f} ms\n"
            f" update  : {phases.update:.2f} ms")  # fmt: skip


def _summary(summaries: dict[str, Summary], name: str, fallback: Callable[[], Sequence[float]]) -> Summary:
    """The record's summary of ``name`` over the steady steps; a run too short to have one (a 1-step run)
    falls back to the steps it kept."""
    found = summaries.get(name)
    return found if found is not None and found.count else Summary.of(fallback())


def phase_summary(record: PhaseRecord, rank: int, phase: str) -> Summary:
    """``phase`` on ``rank`` over the steady steps."""
    rows = record.steady_rows(rank) or record.ranks[rank].rows
    return _summary(record.ranks[rank].summaries, phase, lambda: [getattr(r.ms, phase) for r in rows])


def _busy_median(rows: list[StepRow], phase: str) -> float:
    return statistics.median(getattr(r.ms, phase) for r in rows)


def phase_table(record: PhaseRecord, comm: Optional[CommRecord] = None) -> str:
    """Per phase: warm-up (step 0, rank 0), median/min/max over steady steps of all ranks, the slowest rank."""
    n_ranks = len(record.ranks)
    first = record.ranks[0].row(0)
    rows = []
    for phase in PHASES:
        per_rank = [phase_summary(record, r, phase) for r in range(n_ranks)]
        pooled = Summary.merged(per_rank)
        slowest = max(range(n_ranks), key=lambda r: per_rank[r].median)
        warmup = fmt_ms(getattr(first.ms, phase)) if first else "-"
        rows.append((phase, warmup, fmt_ms(pooled.median), fmt_ms(pooled.min), fmt_ms(pooled.max),
                     f"rank {slowest}: {fmt_ms(per_rank[slowest].median)}"))  # fmt: skip
    header = ["phase", "step 0", "median", "min", "max", "slowest rank (median)"]
    busy = record.ranks[0].busy_ms  # GPU kernel time inside each phase of the profiled steps
    if busy:
        header.append("GPU busy (rank 0)")
        rows = [(*row, fmt_ms(_busy_median(busy, phase))) for row, phase in zip(rows, PHASES, strict=True)]
    n_steady = phase_summary(record, 0, "step").count
    clock = record.meta.clock + CLOCKS.get(record.meta.clock, "")
    precision = "" if record.meta.precision == DEFAULT_PRECISION else f", precision {record.meta.precision}"
    title = (f"Phase times ({clock}), {n_ranks} rank(s){precision}{_micro_note(record)}, step 0 = warm-up, then "
             f"{n_steady} steady step(s)")  # fmt: skip
    profiled = [s for s in record.profiled_steps if record.ranks[0].row(s)]
    if profiled:
        which = f"step {profiled[0]}" if len(profiled) == 1 else f"steps {profiled[0]}-{profiled[-1]}"
        why = "for the GPU-busy column" if busy else "without completing a GPU-busy measurement"
        title += f" ({which} ran under the profiler {why}, left out of the others)"
    text = title + ":\n" + table(tuple(header), rows) + _outside_lines(record) + _skipped_line(record)
    if record.roofline:
        text += "\n" + roofline_table(record)
    return text + "\n" + verdict(record, comm)


def micro_batches(record: PhaseRecord) -> int:
    """Batches per optimizer step (gradient accumulation), as rank 0's steady steps ran them (most of them)."""
    counts = [r.micro_batches for r in record.steady_rows(0) or record.ranks[0].rows]
    return max(set(counts), key=counts.count) if counts else 1


def _micro_note(record: PhaseRecord) -> str:
    n = micro_batches(record)
    return "" if n == 1 else f", {n} micro-batches per optimizer step (each phase summed over them)"


def _outside_lines(record: PhaseRecord) -> str:
    """Work inside fit that is no training step's (validation), kept out of the table: time and count."""
    lines = []
    for what in sorted({w for r in record.ranks for w in r.outside}):
        per_rank = [r.outside.get(what, Summary()) for r in record.ranks]
        slowest = max(range(len(per_rank)), key=lambda i: per_rank[i].total)
        s = per_rank[slowest]
        lines.append(f"\n{what} inside fit, kept out of the steps above: {s.count} run(s), {fmt_ms(s.total)} in all, "
                     f"{fmt_ms(s.median)} median (rank {slowest}, the longest)")  # fmt: skip
    return "".join(lines)


def _skipped_line(record: PhaseRecord) -> str:
    if not record.skipped_count:
        return ""
    steps = ", ".join(map(str, record.skipped_steps[:10])) + (", ..." if record.skipped_count > 10 else "")
    return (f"\n{record.skipped_count} optimizer step(s) skipped by the {record.meta.precision} grad scaler (inf/NaN "
            f"gradients, no update; the scale was lowered): step(s) {steps}; left out of the medians")  # fmt: skip


def verdict(record: PhaseRecord, comm: Optional[CommRecord] = None) -> str:
    """One line: what bounds the step, and what would help. A straggler (``comm`` of several ranks) comes
    first: the others' time then goes to waiting for it, and no bucket size helps."""
    found = stragglers.analyse(comm, record) if comm is not None else None
    if found is not None and found.rank is not None:
        return f"Verdict: {stragglers.verdict_line(found)}"
    step_ms = phase_summary(record, 0, "step").median
    busy = record.ranks[0].busy_ms
    if busy:
        share = _busy_median(busy, "step") / step_ms if step_ms else 0.0
        if share >= 0.8:
            return (f"Verdict: GPU-bound: the GPU was busy {share:.0%} of the step; lower precision (bf16), "
                    "fewer FLOPs or faster kernels would help")  # fmt: skip
        return (f"Verdict: host-bound: the GPU was busy {share:.0%} of the step; larger batches, fewer kernel "
                "launches (fused Adam, CUDA graphs) or less per-step Python would help")  # fmt: skip
    if record.meta.clock == "cuda_event":
        why = "no profiled step completed" if record.profiled_steps else "PhaseTimer(kernel_steps=0)"
        return f"Verdict: unknown: GPU-busy time was not measured ({why})"
    shares = {p: phase_summary(record, 0, p).median / step_ms for p in PHASES if p != "step"}
    top = max(shares, key=shares.get)
    return f"Verdict: a CPU run (no device to idle): {top} is {shares[top]:.0%} of the step; {HINTS[top]} would help"


def roofline_table(record: PhaseRecord) -> str:
    """Achieved FLOP/s of forward and backward, achieved bytes/s of the update, and fractions of peak."""
    r = record.roofline
    rows = []
    for phase, work, unit, peak in (
        ("forward", r.forward_flop, "FLOP", r.peak_tflops and r.peak_tflops * 1e12),
        ("backward", r.backward_flop, "FLOP", r.peak_tflops and r.peak_tflops * 1e12),
        ("update", r.update_bytes, "B", r.peak_gbps and r.peak_gbps * 1e9),
    ):
        ms = phase_summary(record, 0, phase).median
        rate = work / (ms / 1e3) if ms > 0 else math.nan  # per second
        frac = f"{rate / peak:.1%}" if peak else "-"
        achieved = fmt_si(rate, f"{unit}/s") if not math.isnan(rate) else "-"
        rows.append((phase, fmt_si(work, unit), fmt_ms(ms), achieved, frac))
    what = []
    if r.micro_batches > 1:
        what.append(f"a step's work: {r.micro_batches} micro-batches")
    if r.compute_dtype and record.meta.precision != DEFAULT_PRECISION:
        what.append(f"{record.meta.precision}: matmuls in {r.compute_dtype}")
    if r.peak_label:
        what.append(f"peak {r.peak_label}")
    title = "Roofline (rank 0, steady median" + "".join(f"; {w}" for w in what) + "):\n"
    return title + table(("phase", "work", "time", "achieved", "of peak"), rows)


def comm_summary(record: CommRecord, rank: int, name: str) -> Summary:
    """``name`` (``bucket<i>.ms``, ``bucket<i>.ready_ms``, ``busy_ms``, ``exposed_ms``, ``total_ms``) on ``rank``
    over the steady steps with the final layout."""
    rows = [r for r in record.ranks[rank].rows if r.bytes == record.layout]

    def kept() -> list[float]:
        if name == "total_ms":
            return [sum(r.ms) for r in rows]
        if name.startswith("bucket"):
            b, _, field_name = name[len("bucket") :].partition(".")
            return [getattr(r, field_name)[int(b)] for r in rows]
        return [getattr(r, name) for r in rows]

    return _summary(record.ranks[rank].summaries, name, kept)


def comm_table(record: CommRecord, phases: Optional[PhaseRecord] = None) -> str:
    """Per bucket: bytes, all-reduce time, algbw and busbw (nccl-tests definitions); per step: totals; on
    several ranks, the straggler verdict (``lit_ddp.analysis.stragglers``), with ``phases`` naming its slow phase.

    Buckets are those of the final layout (DDP rebuilds its buckets after the first step), timed over the
    steady steps that used it. With several ranks, a bucket's time is its transfer (the shortest duration across
    ranks: the last rank to arrive waits for no one), shown beside the longest wait for the last arrival, so
    that a straggler does not pass for a slow link.
    """
    n = record.meta.world_size
    ring = 2 * (n - 1) / n
    found = stragglers.analyse(record, phases)
    rows = []
    for b, nbytes in enumerate(record.layout):
        t = found.transfer_per_bucket_ms[b] if found else comm_summary(record, 0, f"bucket{b}.ms").median
        algbw = nbytes / (t / 1e3) / 1e9 if t > 0 else math.nan
        row = (b, f"{nbytes:,}", fmt_ms(t), f"{algbw:.2f} GB/s", f"{algbw * ring:.2f} GB/s")
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
        f"({record.param_bytes:,} bytes of gradients); each rank sends 2(n-1)/n x S = {ring * total:,.0f} bytes "
        f"in a ring all-reduce.\ncommunication {fmt_ms(busy)} per step, of which {fmt_ms(exposed)} exposed "
        f"(not hidden under backward compute)"
        + _precision_line(record)
        + _accumulation_line(record)
        + _unused_line(record)
        # A straggler is the phase table's verdict when there is one; otherwise it is said here.
        + (f"\n{stragglers.verdict_line(found)}" if found and (phases is None or found.rank is None) else "")
    )


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
