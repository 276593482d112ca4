"""Tables of per-rank profiler traces: where each GPU's time went, per phase, the collectives of each step, the
verdict (beyond the noise: ``lit_ddp.derive.noise``), every figure as JSON; ``python -m lit_ddp.trace_report``
prints them.

    python -m lit_ddp.trace_report runs/mini_train/version_0

The figures are ``lit_ddp.derive.trace``'s; how they are defined: docs/traces.md.
"""

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Optional

from lit_ddp.derive import noise
from lit_ddp.derive.trace import Breakdown, RankAnalysis, combine
from lit_ddp.formatting import fmt_bandwidth, fmt_ms, table
from lit_ddp.present.bound import LEAD_SHARE
from lit_ddp.records import phases as phase_table


def fmt_us(value: float) -> str:
    """Microseconds under 1 ms as printed (999.95 us is 1.00 ms, not 1000.0 us), else as ``fmt_ms``."""
    return f"{value:.1f} us" if round(value, 1) < 1000 else fmt_ms(value / 1000)


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _steps(analysis: RankAnalysis) -> str:
    counted = [s.step for s in analysis.steps if s.counted]
    if not counted:
        return "-"
    return f"{counted[0]}" if len(counted) == 1 else f"{counted[0]}-{counted[-1]}"


def _ms(us: float) -> str:
    return fmt_ms(us / 1e3)


def _row(label: object, b: Breakdown) -> tuple:
    overlap = "-" if b.comm_comp_overlap_pct is None else f"{b.comm_comp_overlap_pct:.1f}%"
    return (label, _ms(b.span_us), _ms(b.busy_us), _ms(b.compute_us), _ms(b.communication_us), overlap,
            f"{_ms(b.idle_us)} ({_pct(b.idle_us, b.span_us)})", _ms(b.host_wait_us), _ms(b.kernel_wait_us),
            _ms(b.other_wait_us))  # fmt: skip


_HEADER = ("span", "busy", "compute", "communication", "overlap", "idle", "host wait", "kernel wait", "other wait")


def rank_table(analyses: Sequence[RankAnalysis]) -> str:
    """Per rank: the module docstring's figures of ``lit_ddp.derive.trace`` over its counted steps."""
    left_out = [s.step for a in analyses for s in a.steps if not s.counted]
    note = f"; the last step ({left_out[0]}) left out, as HTA leaves it out" if left_out else ""
    # _row's label is sliced off here.
    rows = [(a.rank, _steps(a), *_row("", a.total)[1:]) for a in analyses]
    title = (f"GPU time per rank (union over every stream; overlap = share of communication under compute; "
             f"idle split by what ended each gap{note}):")  # fmt: skip
    text = title + "\n" + table(("rank", "steps", *_HEADER), rows)
    world = {a.world_size for a in analyses} - {None}
    if world and max(world) > len(analyses):
        text += f"\n{len(analyses)} of {max(world)} ranks' traces found: the others are not in these figures"
    return text


def trace_phase_table(analysis: RankAnalysis) -> Optional[str]:
    """One rank's figures per phase (the ops each phase queued), summed over its counted steps; None without
    phase ranges in its trace."""
    if not analysis.phases:
        return None
    rows = [_row(p, analysis.phases[p]) for p in phase_table.names() if p in analysis.phases]
    title = f"Per phase, rank {analysis.rank} (the GPU ops each phase's CPU range queued, steps {_steps(analysis)}):"
    return title + "\n" + table(("phase", *_HEADER), rows)


def collective_table(analysis: RankAnalysis) -> Optional[str]:
    """One rank's collectives, step by step, and each step's exposed communication; None without any."""
    if not analysis.collectives:
        return None
    rows = [(c.step if c.step is not None else "-", c.name, c.kind, "?" if c.bytes is None else f"{c.bytes:,}",
             fmt_us(c.duration_us), "-" if c.algbw_gbps is None else fmt_bandwidth(c.algbw_gbps),
             "-" if c.busbw_gbps is None else fmt_bandwidth(c.busbw_gbps)) for c in analysis.collectives]  # fmt: skip
    text = (f"Collectives of rank {analysis.rank} ({len(analysis.collectives)} NCCL kernels; busbw by nccl-tests' "
            "factors for the group size):\n" + table(("step", "collective", "kind", "bytes", "time", "algbw", "busbw"),
                                                     rows))  # fmt: skip
    exposed = [f"step {s.step} {fmt_us(s.exposed_comm_us)}" + ("" if s.counted else " (not counted)")
               for s in analysis.steps if s.exposed_comm_us is not None]  # fmt: skip
    if exposed:
        text += ("\nExposed communication (gradient all-reduce time after backward's last compute kernel): "
                 + ", ".join(exposed))  # fmt: skip
    return text


def verdict_parts(analyses: Sequence[RankAnalysis]) -> dict[str, list[float]]:
    """``{part: per-step samples, us}`` that the verdict weighs: per counted step every rank's trace holds, the
    mean over ranks of its idle time, its compute and its communication that no compute hid."""
    per_rank = [{s.step: s.breakdown for s in a.steps if s.counted} for a in analyses]
    # No ranks: no steps (set.intersection() of nothing raises).
    steps = sorted(set.intersection(*(set(d) for d in per_rank))) if per_rank else []

    def mean(value) -> list[float]:
        return [statistics.fmean(value(d[s]) for d in per_rank) for s in steps]

    return {"idle": mean(lambda b: b.idle_us), "compute": mean(lambda b: b.compute_us),
            "communication": mean(lambda b: b.communication_us - b.overlap_us),
            "span": mean(lambda b: b.span_us)}  # fmt: skip


_PART = {"idle": "idle time", "compute": "compute", "communication": "communication no compute hid"}


def trace_verdict(analyses: Sequence[RankAnalysis]) -> str:
    """One line: what bounds the GPUs and what would help. The largest of idle time, compute and communication
    that no compute hides is named only when its per-step lead over the next (paired: the same steps, the mean
    over ranks) is beyond the noise (``lit_ddp.derive.noise``) and at least ``LEAD_SHARE`` of the span; a
    profile of fewer than ``noise.MIN_SAMPLES`` counted steps can't tell, and says so."""
    parts = verdict_parts(analyses)
    span = parts.pop("span")
    n = len(span)
    t = combine(a.total for a in analyses)
    share = {"idle": t.idle_us, "compute": t.compute_us, "communication": t.communication_us - t.overlap_us}
    of_span = {k: f"{v / t.span_us:.0%}" if t.span_us else "-" for k, v in share.items()}
    shares = ", ".join(f"{_PART[k]} {of_span[k]}" for k in sorted(share, key=share.get, reverse=True))
    if n < noise.MIN_SAMPLES:
        return (f"Verdict: can't tell what bounds the GPUs: the profile holds {n} counted step(s) on every rank, "
                f"fewer than the {noise.MIN_SAMPLES} the noise model needs to tell one part's lead from the steps' "
                f"noise (over them: {shares} of the span); profile {noise.MIN_SAMPLES} or more steps "
                f"(torch.profiler.schedule(active={noise.MIN_SAMPLES}) or more)")  # fmt: skip
    medians = {p: statistics.median(v) for p, v in parts.items()}
    top, second = sorted(parts, key=medians.get, reverse=True)[:2]
    gap = noise.median_interval([x - y for x, y in zip(parts[top], parts[second], strict=True)])
    by = f"{_ms(gap.estimate)} per step ({_ms(gap.low)} to {_ms(gap.high)}, 95%, {n} steps)"
    if noise.call(gap, null=LEAD_SHARE * statistics.median(span)) != "slower":
        floor = f"not beyond the noise above {LEAD_SHARE:.0%} of the span"
        why = "within the noise" if not gap.excludes(0.0) else floor
        return (f"Verdict: can't tell what bounds the GPUs, because {_PART[top]} ({_ms(medians[top])} per step) and "
                f"{_PART[second]} ({_ms(medians[second])}), the largest, differ by {by}: {why} ({shares} of the "
                "span); profile more steps, or python -m lit_ddp.tune measures what DDP's knobs change")  # fmt: skip
    lead = f"{by} over {_PART[second]}, the next"
    if top == "compute":
        return (f"Verdict: GPU-bound: compute kernels ran {of_span['compute']} of the GPUs' span, {lead}; lower "
                "precision (bf16), fewer FLOPs or faster kernels would help")  # fmt: skip
    if top == "communication":
        return (
            f"Verdict: communication-bound: {of_span['communication']} of the span only communication ran, which "
            f"no compute hid, {lead}; what a bucket size or compression would change depends on the bytes and the "
            "link: python -m lit_ddp.tune measures it on the model"
        )
    waits = f"host wait {_pct(t.host_wait_us, t.idle_us)}, kernel wait {_pct(t.kernel_wait_us, t.idle_us)}"
    if t.other_wait_us > t.host_wait_us + t.kernel_wait_us:
        return (f"Verdict: stalled: the GPUs were idle {of_span['idle']} of their span with work queued (other wait "
                f"{_pct(t.other_wait_us, t.idle_us)} of it), {lead}: a slower rank or a host sync holds them back; "
                "compare the ranks' rows")  # fmt: skip
    return (f"Verdict: host-bound: the GPUs were idle {of_span['idle']} of their span ({waits} of it), {lead}; "
            "larger batches per rank, fewer kernel launches (CUDA graphs, torch.compile, a fused optimizer) or less "
            "per-step Python would help")  # fmt: skip


def trace_report(analyses: Sequence[RankAnalysis]) -> str:
    """Every table and the verdict, as printed."""
    parts = [rank_table(analyses), *(trace_phase_table(a) for a in analyses[:1]), collective_table(analyses[0])]
    return "\n\n".join(p for p in parts if p) + "\n" + trace_verdict(analyses)


def to_json(analyses: Sequence[RankAnalysis]) -> dict[str, Any]:
    """``{"ranks": [...]}``: per rank its totals (``lit_ddp.derive.trace.Breakdown``'s fields), counted steps, phases,
    every step's figures and its collectives, times in microseconds."""

    def ranks(a: RankAnalysis) -> dict[str, Any]:
        return {"rank": a.rank, "world_size": a.world_size, "file": str(a.path), **asdict(a.total),
                "counted_steps": [s.step for s in a.steps if s.counted],
                "phases": {p: asdict(b) for p, b in a.phases.items()},
                "steps": [{"step": s.step, "counted": s.counted, **asdict(s.breakdown),
                           "exposed_comm_us": s.exposed_comm_us, "phases": {p: asdict(b) for p, b in s.phases.items()}}
                          for s in a.steps],
                "collectives": [asdict(c) for c in a.collectives]}  # fmt: skip

    return {"ranks": [ranks(a) for a in analyses]}
