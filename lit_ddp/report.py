"""A run's record, or anyone's profiler traces -> the summary tables and a picture.

    python -m lit_ddp.report runs/mini_train_profile/version_0
    python -m lit_ddp.report runs/mini_train_profile/version_0 --forecast 8,64,512 --link nvlink+ib400
    python -m lit_ddp.report --trace DIR --json trace.json

Reads ``phases.json`` (PhaseTimer) and ``comm.json`` (CommMonitor) from a run directory (``lit_ddp.records.schema``),
prints the same tables the callbacks print at the end of training (``lit_ddp.analysis.phases``), and writes
``phases.png``: stacked forward / backward / update / other bars per kept step (rank 0) and a timeline of one
steady step per rank, with each bucket's all-reduce and its exposed part. With ``--trace``, reads a folder of
per-rank ``torch.profiler`` traces instead (``lit_ddp.trace_report``). The pictures need matplotlib
(``pip install 'lit_ddp[plot]'``).
"""

import argparse
import sys
from pathlib import Path
from typing import Optional

from lit_ddp import forecast, trace_report
from lit_ddp.analysis.comm import comm_table
from lit_ddp.analysis.phases import phase_table
from lit_ddp.errors import RecordError
from lit_ddp.records.schema import BOUNDARIES, PHASES, CommRecord, PhaseRecord, load_run


def plot(phases: PhaseRecord, comm: Optional[CommRecord], out: Path) -> Path:
    """Left: stacked phase bars per kept step (rank 0). Right: a timeline of one steady step per rank: the phases
    as segments, each bucket's all-reduce as a segment below them, its exposed part (after backward) hatched."""
    # The Figure API, not pyplot: no backend switch and no global state, so this also works inside a notebook
    # without breaking its inline plots.
    from matplotlib.figure import Figure

    colors = {"forward": "#4C72B0", "backward": "#DD8452", "update": "#55A868", "data": "#937860", "other": "#BBBBBB"}
    fig = Figure(figsize=(13, 4.5))
    ax_step, ax_line = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    rows = phases.ranks[0].rows
    steps = [r.step for r in rows]
    bottom = [0.0] * len(steps)
    for phase in PHASES[:-1]:
        heights = [max(getattr(r.ms, phase), 0.0) for r in rows]
        ax_step.bar(steps, heights, bottom=bottom, color=colors[phase], label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax_step.set(title=f"per step, rank 0 ({phases.meta.clock})", xlabel="step", ylabel="ms")
    ax_step.legend(loc="upper right", fontsize=8)
    _timeline(ax_line, phases, comm, colors)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def _timeline(ax, phases: PhaseRecord, comm: Optional[CommRecord], colors: dict[str, str]) -> None:
    """One steady step per rank (the kept step whose rank-0 time is the median), ms from the step's start."""
    steady = phases.steady_rows(0) or phases.ranks[0].rows
    by_time = sorted(steady, key=lambda r: r.ms.step)
    step = by_time[len(by_time) // 2].step
    at = {name: i for i, name in enumerate(BOUNDARIES)}
    spans = (("forward", "forward_start", "forward_end"), ("backward", "backward_start", "backward_end"),
             ("update", "update_start", "update_end"), ("data", "data_start", "end"))  # fmt: skip
    for rank, kept in enumerate(phases.ranks):
        row = kept.row(step)
        if row is None:
            continue
        marks = row.offsets_ms
        y = 2 * rank
        ax.broken_barh([(0, marks[at["end"]])], (y + 0.55, 0.4), color=colors["other"])
        for phase, start, end in spans:
            ax.broken_barh([(marks[at[start]], marks[at[end]] - marks[at[start]])], (y + 0.55, 0.4),
                           color=colors[phase], label=phase if rank == 0 else None)  # fmt: skip
        buckets = next((b for b in comm.ranks[rank].rows if b.step == step), None) if comm else None
        if buckets is None:
            continue
        backward_start, backward_end = marks[at["backward_start"]], marks[at["backward_end"]]
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
        ax.vlines(backward_end, y, y + 1, color="#888888", lw=0.8)  # backward's compute ends
    ax.set_yticks([2 * r + 0.5 for r in range(len(phases.ranks))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(phases.ranks))])
    ax.set(title=f"timeline of step {step} (the median step)", xlabel="ms from the step's start")
    # Below the axes: inside them it covered the last rank's bars.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=6, fontsize=8, frameon=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_ddp.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", help="a run's log directory (phases.json / comm.json)")
    parser.add_argument("--no-plot", action="store_true", help="tables only")
    group = parser.add_argument_group("profiler traces")
    group.add_argument("--trace", type=Path, metavar="DIR", help="read the per-rank torch.profiler traces under DIR")
    group.add_argument("--json", type=Path, metavar="OUT", help="with --trace: write every figure as JSON (us)")
    forecast.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.trace is not None:
        if args.run_dir is not None or args.forecast:
            parser.error("--trace DIR reads traces alone: give no run directory or --forecast with it")
        return trace_report.run(args.trace, args.json, picture=not args.no_plot)
    if args.json is not None:
        parser.error("--json goes with --trace")
    if args.run_dir is None:
        parser.error("give a run directory, or --trace DIR")
    if not args.run_dir.is_dir():
        parser.error(f"{args.run_dir} is not a directory")
    try:
        phases, comm = load_run(args.run_dir)
    except RecordError as err:
        parser.error(str(err))
    if phases is None and comm is None:
        parser.error(f"{args.run_dir} holds neither phases.json nor comm.json: was PhaseTimer or CommMonitor on?")
    if phases is not None:
        print(phase_table(phases, comm))
    if comm is not None:
        print(comm_table(comm, phases))
    if phases is not None and not args.no_plot:
        try:
            out = plot(phases, comm, args.run_dir / "phases.png")
        except ImportError:
            print("no picture: matplotlib is missing (pip install 'lit_ddp[plot]')", file=sys.stderr)
            return 1
        print(f"wrote {out}")
    if args.forecast:
        try:
            print(forecast.run(args, args.run_dir))
        except forecast.ForecastError as err:
            parser.error(str(err))
        straggler = comm.straggler if comm is not None else None
        if straggler and straggler["rank"] is not None:
            # The model takes each phase from the slowest rank and models backward from the buckets' ready times
            # (before any wait): the straggler's slow phase is in every step at every N, its victims' wait is not.
            print(f"straggler: rank {straggler['rank']} ({straggler['cause'] or 'its phases'} "
                  f"{straggler['cause_extra_ms']:+.1f} ms) paces every step above: each phase is the slowest rank's, "
                  f"and the others' {max(straggler['wait_ms']):.1f} ms wait for it is not counted again")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
