"""The pictures: ``phases.png`` of a run's record and ``trace.png`` of profiler traces, and how every command
writes one (``forecast.png`` too).

    python -m lit_ddp.report runs/mini_train_profile/version_0      # phases.png beside the record
    python -m lit_ddp.trace_report runs/mini_train/version_0        # trace.png beside the traces

matplotlib's Figure API, not pyplot: no backend switch and no global state, so they draw inside a notebook too.
matplotlib is the ``plot`` extra; without it every command prints its text, says how to get the picture, and
succeeds (``write``).
"""

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lit_ddp.analysis.run_analysis import RunAnalysis
from lit_ddp.derive.trace import GRADIENT, RankAnalysis, merge
from lit_ddp.errors import EXIT_NO_PICTURE
from lit_ddp.formatting import fmt_ms
from lit_ddp.records import phases as phase_table
from lit_ddp.records.schema import CommRecord, PhaseRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOT_EXTRA = "pip install 'lit_ddp[plot]'"
DPI = 110


class MatplotlibMissing(ImportError):
    """matplotlib is not installed (the ``plot`` extra)."""


def figure(**kwargs: Any) -> "Figure":
    """A new matplotlib ``Figure`` (``kwargs`` as ``Figure`` takes them); ``MatplotlibMissing`` without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MatplotlibMissing(f"matplotlib is missing ({PLOT_EXTRA})") from err
    return Figure(**kwargs)


def save(fig: "Figure", out: Path) -> Path:
    """``fig`` as the PNG ``out``."""
    fig.savefig(out, dpi=DPI)
    return out


def write(draw: Callable[[], "Figure"], out: Path) -> int:
    """A command's picture, the same answer in every command: ``draw()`` saved to ``out``, ``wrote OUT`` on stdout
    and 0. Without matplotlib (an install without the ``plot`` extra), one line on stderr that says how to get the
    picture, and 0: the text printed by then is the whole answer. When ``out`` cannot be written, one line on
    stderr and ``EXIT_NO_PICTURE`` (``--no-plot`` asks for no picture)."""
    try:
        save(draw(), out)
    except MatplotlibMissing as err:
        print(f"no {out.name}: {err}; the text above is complete", file=sys.stderr)
        return 0
    except OSError as err:
        print(f"no {out.name}: {out}: {err.strerror}", file=sys.stderr)
        return EXIT_NO_PICTURE
    print(f"wrote {out}")
    return 0


def phases_figure(analysis: RunAnalysis) -> "Figure":
    """``phases.png``. Left: stacked phase bars per kept step (rank 0), the profiled steps shaded, the axis clipped
    above the steady steps so that the warm-up does not flatten them (its total written on its bar). Right: a
    timeline of one steady step per rank: the phases as segments, each bucket's all-reduce as a segment below
    them, its exposed part (after the last gradient was handed over, a dashed line) hatched."""
    phases, comm = analysis.phases, analysis.comm
    fig = figure(figsize=(13, 4.5))
    ax_step, ax_line = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    _phase_bars(ax_step, phases)
    _phase_timeline(ax_line, phases, comm)
    fig.tight_layout()
    return fig


# The steady steps' tallest bar fills this share of the clipped axis: a warm-up step up to this much taller is
# drawn whole.
_HEADROOM = 1.4


def _phase_bars(ax, phases: PhaseRecord) -> None:
    rows = phases.ranks[0].rows
    steps = [r.step for r in rows]
    bottom = [0.0] * len(steps)
    for phase in phase_table.table():
        heights = [max(r.ms[phase.name], 0.0) for r in rows]
        ax.bar(steps, heights, bottom=bottom, color=phase.colour, label=phase.name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    profiled = [s for s in steps if s in set(phases.profiled_steps)]
    if profiled:
        ax.axvspan(min(profiled) - 0.5, max(profiled) + 0.5, color="#F2D95C", alpha=0.35, lw=0, zorder=0,
                   label=f"profiled: steps {_steps_text(profiled)}")  # fmt: skip
    steady = {r.step for r in phases.steady_rows(0)}
    left_out = {*phases.profiled_steps, *phases.skipped_steps}
    warm_up = [s for s in steps if s not in steady and s not in left_out]
    top = max((b for s, b in zip(steps, bottom, strict=True) if s in steady), default=0.0) * _HEADROOM
    if top > 0 and max(bottom) > top:  # a warm-up (or profiled) step far above the steady ones: clip, and say so
        ax.set_ylim(0, top)
        for s, total in zip(steps, bottom, strict=True):
            if total > top:
                ax.annotate(f"{fmt_ms(total)} ↑", (s, top), xytext=(0, -3), textcoords="offset points", ha="center",
                            va="top", fontsize=7, bbox={"boxstyle": "round", "fc": "white", "lw": 0})  # fmt: skip
        ax.set_title(f"per step, rank 0 ({phases.meta.clock}); clipped above the steady steps", fontsize=10)
    else:
        ax.set_title(f"per step, rank 0 ({phases.meta.clock})")
    warm = f" ({_steps_text(warm_up)}: warm-up)" if warm_up else ""
    ax.set(xlabel=f"step{warm}", ylabel="ms")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8, frameon=False)


def _steps_text(steps: Sequence[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def _phase_timeline(ax, phases: PhaseRecord, comm: Optional[CommRecord]) -> None:
    """One steady step per rank (the kept step whose rank-0 time is the median), ms from the step's start."""
    steady = phases.steady_rows(0) or phases.ranks[0].rows
    by_time = sorted(steady, key=lambda r: r.ms.step)
    step = by_time[len(by_time) // 2].step
    remainder = phase_table.REMAINDER
    all_reducing = next(p for p in phase_table.marked() if p.name == phase_table.ALL_REDUCING)
    for rank, kept in enumerate(phases.ranks):
        row = kept.row(step)
        if row is None:
            continue
        marks = row.offsets_ms
        y = 2 * rank
        # The whole step in grey: what no phase covers is "other".
        ax.broken_barh([(0, marks[phase_table.END])], (y + 0.55, 0.4), color=phase_table.colour(remainder),
                       label=remainder if rank == 0 else None)  # fmt: skip
        for phase in phase_table.marked():
            start, end = marks[phase.opens], marks[phase.closes]
            ax.broken_barh([(start, end - start)], (y + 0.55, 0.4), color=phase.colour,
                           label=phase.name if rank == 0 else None)  # fmt: skip
        buckets = next((b for b in comm.ranks[rank].rows if b.step == step), None) if comm else None
        if buckets is None:
            continue
        backward_start = marks[all_reducing.opens]
        last_ready = backward_start + max(buckets.ready_ms)
        exposed_label = "exposed" if rank == 0 else None  # on the first exposed part drawn, whichever bucket
        for b, (r, d) in enumerate(zip(buckets.ready_ms, buckets.ms, strict=True)):
            start, end = backward_start + r, backward_start + r + d
            ax.broken_barh([(start, d)], (y + 0.05, 0.4), facecolor="#8172B3", edgecolor="white",
                           label="all-reduce (one per bucket)" if rank == 0 and b == 0 else None)  # fmt: skip
            if end > last_ready:  # what runs after the last gradient is ready is not hidden under compute
                lo = max(start, last_ready)
                ax.broken_barh([(lo, end - lo)], (y + 0.05, 0.4), facecolor="none", edgecolor="#C44E52",
                               hatch="///", label=exposed_label)  # fmt: skip
                exposed_label = None
        # Not the backward phase's end: that comes after DDP's wait for the last all-reduce, the exposed part.
        ax.vlines(last_ready, y, y + 1, color="#555555", lw=0.8, linestyles="dashed",
                  label="last gradient ready" if rank == 0 else None)  # fmt: skip
    ax.set_yticks([2 * r + 0.5 for r in range(len(phases.ranks))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(phases.ranks))])
    ax.set(title=f"timeline of step {step} (the median step)", xlabel="ms from the step's start")
    # Below the axes: inside them it covered the last rank's bars.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=6, fontsize=8, frameon=False)


_TRACE_COLORS = {
    "compute only": "#4C72B0", "compute + communication": "#8172B3", "communication only": "#C44E52",
    "memory only": "#55A868", "host wait": "#DDDDDD", "kernel wait": "#BBBBBB", "other wait": "#888888",
}  # fmt: skip


def trace_figure(analyses: Sequence[RankAnalysis]) -> "Figure":
    """``trace.png``. Left: each rank's span split into compute, communication, memory and the three waits.
    Right: the first counted step of each rank on the GPU, compute by phase above, collectives below (exposed part
    hatched)."""
    fig = figure(figsize=(14, 2.6 + 0.9 * len(analyses)))
    ax_bar, ax_line = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    for y, a in enumerate(analyses):
        t, left = a.total, 0.0
        comm_only = t.communication_us - t.overlap_us
        for label, us in (("compute only", t.compute_us - t.overlap_us), ("compute + communication", t.overlap_us),
                          ("communication only", comm_only), ("memory only", t.non_compute_us - comm_only),
                          ("host wait", t.host_wait_us), ("kernel wait", t.kernel_wait_us),
                          ("other wait", t.other_wait_us)):  # fmt: skip
            ax_bar.barh(y, us / 1e3, left=left, color=_TRACE_COLORS[label], label=label if y == 0 else None)
            left += us / 1e3
        _trace_timeline(ax_line, a, y)
    for ax in (ax_bar, ax_line):
        ax.set_yticks(range(len(analyses)), [f"rank {a.rank}" for a in analyses])
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=7)
    ax_bar.set(title="GPU time over the counted steps", xlabel="ms")
    ax_line.set(title="first counted step on the GPU", xlabel="ms from the step's first GPU op")
    fig.tight_layout()
    return fig


def _trace_timeline(ax, analysis: RankAnalysis, y: int) -> None:
    step = next((s for s in analysis.steps if s.counted), None)
    if step is None:
        return
    ops = [p for p in analysis.ops if p.step == step.step]
    t0 = min(p.op.start_us for p in ops)
    label = {"compute": True, GRADIENT: GRADIENT, "other": "other collective", "exposed": "exposed"} if y == 0 else {}
    for phase in dict.fromkeys(p.phase for p in ops):  # in order of appearance
        compute = [(p.op.start_us, p.op.end_us) for p in ops if p.phase == phase and p.op.kind == "compute"]
        ax.broken_barh([((s - t0) / 1e3, (e - s) / 1e3) for s, e in merge(compute)], (y + 0.02, 0.45),
                       color=phase_table.colour(phase) if phase in phase_table.names() else "#999999",
                       label=f"{phase or 'compute'} compute" if label else None)  # fmt: skip
    ends = [p.op.end_us for p in ops if p.phase == phase_table.ALL_REDUCING and p.op.kind == "compute"]
    for c in (c for c in analysis.collectives if c.step == step.step):
        kind = GRADIENT if c.kind == GRADIENT else "other"
        ax.broken_barh([((c.start_us - t0) / 1e3, c.duration_us / 1e3)], (y - 0.47, 0.45),
                       color="#8172B3" if kind == GRADIENT else "#AAAAAA",
                       label=label.pop(kind, None))  # fmt: skip
        if ends and kind == GRADIENT and c.start_us + c.duration_us > max(ends):
            lo = max(c.start_us, max(ends))
            ax.broken_barh([((lo - t0) / 1e3, (c.start_us + c.duration_us - lo) / 1e3)], (y - 0.47, 0.45),
                           facecolor="none", edgecolor="#C44E52", hatch="///",
                           label=label.pop("exposed", None))  # fmt: skip
