"""What a run's ``phases.json`` says: the phase table, the roofline and the verdict, as text.

    python -m lit_ddp.report runs/mini_train_profile/version_0     # prints these from phases.json / comm.json

The callbacks print the same at the end of training. This module reads ``lit_ddp.records.schema`` types only and pulls
in no command line, so collection (the callbacks) may import it; ``lit_ddp.report`` is the CLI and the picture.
"""

import math
import statistics
from collections.abc import Mapping
from typing import Optional

from lit_ddp.analysis.run_analysis import RunAnalysis
from lit_ddp.derive import stragglers
from lit_ddp.derive.summaries import micro_batches, phase_summary
from lit_ddp.formatting import fmt_bandwidth, fmt_ms, fmt_si, table
from lit_ddp.present.bound import LEAD_SHARE, cpu_bound, steady_count
from lit_ddp.present.memory import memory_cells, memory_line
from lit_ddp.records import phases as step_phases
from lit_ddp.records.schema import CommRecord, PhaseRecord, Sketch, StepRow

CLOCKS = {  # what each clock's times mean
    "perf_counter": ": host time",
    "cuda_event": ": device time between the marks, idle gaps included",
}

DEFAULT_PRECISION = "32-true"  # Lightning's default: the tables name any other, and the dtype on the wire

# What each phase is (its row's meaning in lit_ddp.records.phases) is said with the verdict in place of advice that
# no figure backs: a change gets a figure from python -m lit_ddp.tune (measured) or python -m lit_ddp.forecast (a
# what-if), never from a rule.
# The GPU bounds the step when it is busy this share of it at least, in every profiled step (_gpu_verdict).
BUSY_BOUND = 0.8
MEASURE = "python -m lit_ddp.tune measures what DDP's knobs and the optimizer's fused step change on this model"
# What each part's bound asks for, said where no figure backs a change (the headline's, lit_ddp.present.headline)


def _busy_median(rows: list[StepRow], phase: str) -> float:
    return statistics.median(getattr(r.ms, phase) for r in rows)


def phase_table(analysis: RunAnalysis, detail: bool = True) -> str:
    """Per phase: warm-up (the fit's first step, rank 0), median/min/max over steady steps of all ranks, the slowest
    rank. A fit resumed from a checkpoint warms up at its resume point (``first_step``). Then the verdict. Without
    ``detail``, only what applies: no memory legend, no roofline column of peak without a peak."""
    record = analysis.phases
    n_ranks = len(record.ranks)
    first = record.ranks[0].row(record.first_step)
    rows = []
    names = step_phases.with_step()
    for phase in names:
        per_rank = [phase_summary(record, r, phase) for r in range(n_ranks)]
        pooled = Sketch.merged(per_rank)
        slowest = max(range(n_ranks), key=lambda r: per_rank[r].median)
        warmup = fmt_ms(getattr(first.ms, phase)) if first else "-"
        rows.append((phase, warmup, fmt_ms(pooled.median), fmt_ms(pooled.min), fmt_ms(pooled.max),
                     f"rank {slowest}: {fmt_ms(per_rank[slowest].median)}"))  # fmt: skip
    header = ["phase", f"step {record.first_step}", "median", "min", "max", "slowest rank (median)"]
    busy = record.ranks[0].busy_ms  # GPU kernel time inside each phase of the profiled steps
    if busy:  # one row, one busy and one memory cell a phase
        header.append("GPU busy (rank 0)")
        rows = [(*row, fmt_ms(_busy_median(busy, phase))) for row, phase in zip(rows, names, strict=True)]
    memory = analysis.memory
    if memory is not None:  # the bytes of the rank whose step peaks highest (lit_ddp.derive.memory)
        header += ["peak memory", "retained"]
        rows = [(*row, *cells) for row, cells in zip(rows, memory_cells(memory), strict=True)]
    n_steady = phase_summary(record, 0, "step").count
    clock = record.meta.clock + CLOCKS.get(record.meta.clock, "")
    precision = "" if record.meta.precision == DEFAULT_PRECISION else f", precision {record.meta.precision}"
    title = (f"Phase times ({clock}), {n_ranks} rank(s){precision}{_micro_note(record)}, {_warmup(record)}, then "
             f"{n_steady} steady step(s)")  # fmt: skip
    profiled = [s for s in record.profiled_steps if record.ranks[0].row(s)]
    if profiled:
        which = f"step {profiled[0]}" if len(profiled) == 1 else f"steps {profiled[0]}-{profiled[-1]}"
        why = ("for the GPU-busy column" if busy else "for the memory columns" if record.memory_source == "cpu_profiler"
               else "without completing a GPU-busy measurement")  # fmt: skip
        title += f" ({which} ran under the profiler {why}, left out of the others)"
    text = title + ":\n" + table(tuple(header), rows) + ("\n" + memory_line(memory) if memory and detail else "")
    text += _outside_lines(record) + _skipped_line(record)
    if record.roofline:
        text += "\n" + roofline_table(record, detail)
    return text + "\n" + verdict(analysis)


def _warmup(record: PhaseRecord) -> str:
    resumed = " (the fit resumed there)" if record.first_step else ""
    return f"step {record.first_step} = warm-up{resumed}"


def _micro_note(record: PhaseRecord) -> str:
    n = micro_batches(record)
    return "" if n == 1 else f", {n} micro-batches per optimizer step (each phase summed over them)"


def _outside_lines(record: PhaseRecord) -> str:
    """Work inside fit that is no training step's (validation), kept out of the table: time and count."""
    lines = []
    for what in sorted({w for r in record.ranks for w in r.outside}):
        per_rank = [r.outside.get(what, Sketch()) for r in record.ranks]
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


def verdict(analysis: RunAnalysis) -> str:
    """One line: what bounds the step, and what would help. A straggler (a run of several ranks) comes first: the
    others' time then goes to waiting for it, and no bucket size helps. The savings quoted are the analysis's
    (``lit_ddp.scaling.advice.wire_savings``)."""
    if analysis.named_straggler is not None:
        return f"Verdict: {stragglers.verdict_line(analysis.named_straggler)}"
    record, step_ms = analysis.phases, analysis.step_ms
    busy = record.ranks[0].busy_ms
    if busy:
        return "Verdict: " + _gpu_verdict(busy, step_ms)
    if record.meta.clock == "cuda_event":
        why = "no profiled step completed" if record.profiled_steps else "PhaseTimer(kernel_steps=0)"
        return f"Verdict: unknown: GPU-busy time was not measured ({why})"
    return "Verdict: a CPU run (no device to idle): " + _cpu_verdict(analysis)


def busy_bound(shares: list[float]) -> Optional[str]:
    """``"gpu"`` where the GPU was busy ``BUSY_BOUND`` of every profiled step, ``"host"`` where of none, else None
    (the shares cross the line: can't tell)."""
    return "gpu" if min(shares) >= BUSY_BOUND else "host" if max(shares) < BUSY_BOUND else None


def _gpu_verdict(busy: list[StepRow], step_ms: float) -> str:
    """GPU- or host-bound by the GPU's busy share of the steady step, named only when every profiled step lies on
    one side of ``BUSY_BOUND``: a few profiled steps give no interval, and a share that crosses the line between
    them is within the noise."""
    shares = [row.ms.step / step_ms if step_ms else 0.0 for row in busy]
    share = _busy_median(busy, "step") / step_ms if step_ms else 0.0
    spread = f" ({min(shares):.0%} to {max(shares):.0%} in the {len(shares)} profiled steps)" if len(shares) > 1 else ""
    bound = busy_bound(shares)
    if bound == "gpu":
        return (f"GPU-bound: the GPU was busy {share:.0%} of the step{spread}; lower precision (bf16), fewer FLOPs or "
                "faster kernels would help")  # fmt: skip
    if bound == "host":
        return (f"host-bound: the GPU was busy {share:.0%} of the step{spread}; larger batches, fewer kernel "
                "launches (fused Adam, CUDA graphs) or less per-step Python would help")  # fmt: skip
    return (f"can't tell whether the GPU or the host bounds the step: the GPU was busy {share:.0%} of it{spread}, "
            f"across the {BUSY_BOUND:.0%} line; PhaseTimer(kernel_steps=N) profiles more steps")  # fmt: skip


def _cpu_verdict(analysis: RunAnalysis) -> str:
    """What takes most of rank 0's step, named only when it leads the next beyond the noise and by ``LEAD_SHARE``
    of the step at least (``lit_ddp.present.bound``); else "can't tell", and why. With CommMonitor's record,
    backward is split: its compute, the all-reduce's exposed transfer, and the wait for a later rank; each figure
    says which of them it is."""
    b = cpu_bound(analysis)
    if b is None:
        n = steady_count(analysis)
        return f"can't tell what bounds the step, because only {n} steady step(s) were kept; {MEASURE}"
    first, step_ms = b.first, analysis.step_ms
    if not b.called:
        why = (
            "within the noise"
            if not b.gap.excludes(0.0)
            else f"not beyond the noise above {LEAD_SHARE:.0%} of the step"
        )
        return (f"can't tell what bounds the step, because {b.name(first)}, {b.share[first]:.0%} of the step, takes "
                f"{b.lead}: {why}; {MEASURE}")  # fmt: skip
    if first == "exposed":
        advice = _wire_advice(analysis.comm, step_ms, analysis.savings)
        return (f"communication-bound: the gradient all-reduce's exposed transfer is {fmt_ms(b.medians[first])} of the "
                f"{fmt_ms(step_ms)} step ({b.share[first]:.0%}), {b.lead}; {advice}")  # fmt: skip
    if first == "wait":
        # Not a bound of its own: with no rank late often and steadily (a straggler comes first, above), the wait
        # is the other ranks' step-to-step variation seen through the all-reduce, which another run of the same
        # job does not repeat (one run of five here, under a burst of load; the four others: can't tell).
        return (f"can't tell what bounds the step, because its largest part is rank 0's wait for a later rank's "
                f"gradients, {fmt_ms(b.medians[first])} per step ({b.share[first]:.0%}), {b.lead}, and no rank is "
                "late often and steadily enough to be named a straggler (the all-reduce table's last line): the wait "
                f"follows the ranks' own variation from step to step, not one rank; run again to see whether it "
                f"repeats; {MEASURE}")  # fmt: skip
    split = "exposed" in b.medians or analysis.phases.meta.world_size == 1  # the all-reducing phase: compute only
    compute = first == step_phases.ALL_REDUCING and split
    what = "the model's compute" if compute else step_phases.meaning(first)
    return f"{b.name(first)} bounds the step, {b.share[first]:.0%} of it: {what}, {b.lead}; {MEASURE}"


def _wire_advice(comm: Optional[CommRecord], step_ms: float, savings: Mapping[str, float]) -> str:
    """The change that cuts the bytes on the wire, with the forecast's figure when the caller had one."""
    if savings:
        return "; ".join(
            f"{label}: step {fmt_ms(step_ms)} -> ~{fmt_ms(step_ms - ms)}, forecast" for label, ms in savings.items()
        )
    if comm is not None and comm.compression:
        return (f"the buckets are {comm.compression} already: python -m lit_ddp.forecast RUN --forecast "
                f"{comm.meta.world_size} --link ... forecasts other links")  # fmt: skip
    # comm is never None here (the exposed part comes from CommMonitor's record).
    return f"python -m lit_ddp.forecast RUN --forecast {comm.meta.world_size if comm else 2} forecasts fp16 compression"


def roofline_table(record: PhaseRecord, detail: bool = True) -> str:
    """Achieved FLOP/s of forward and backward, achieved bytes/s of the update, and fractions of peak (without
    ``detail``, only where a peak is known)."""
    r = record.roofline
    rows = []
    for phase, work, unit, peak in (
        ("forward", r.forward_flop, "FLOP", r.peak_tflops and r.peak_tflops * 1e12),
        ("backward", r.backward_flop, "FLOP", r.peak_tflops and r.peak_tflops * 1e12),
        ("update", r.update_bytes, "B", r.peak_gbps and r.peak_gbps * 1e9),
    ):
        ms = phase_summary(record, 0, phase).median
        rate = work / (ms / 1e3) if ms > 0 else math.nan  # per second
        frac = f"{rate / peak:.1%}" if peak and not math.isnan(rate) else "-"  # no time, no rate: "-", not "nan%"
        # The update's bytes/s as every bandwidth the tool prints (fmt_bandwidth), FLOP/s by fmt_si's rule.
        if unit == "B":
            achieved = fmt_bandwidth(rate / 1e9)
        else:
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
    if not (detail or r.peak_tflops or r.peak_gbps):  # no peak: its column would be dashes
        return title + table(("phase", "work", "time", "achieved"), [row[:-1] for row in rows])
    return title + table(("phase", "work", "time", "achieved", "of peak"), rows)
