"""Per-rank torch.profiler traces -> where each GPU's time went, the collectives of each step, a verdict, a picture.

    python -m lit_ddp.trace_report runs/mini_train/version_0          # Lightning PyTorchProfiler's traces
    python -m lit_ddp.trace_report traces/ --json trace.json --no-plot

Finds the traces under DIR: ``*.pt.trace.json[.gz]`` at any depth (the names ``tensorboard_trace_handler`` and
Lightning's ``PyTorchProfiler`` give them), else every ``*.json[.gz]`` in DIR itself (a directory of one trace
per rank, as HTA reads one); DIR may also be one trace file. Each trace says its own rank (``lit_ddp.analysis.trace``,
where the figures are defined). Prints a table per rank, one per phase where the traces mark phases, the
lowest rank's collectives per step, and a verdict; writes ``trace.png`` beside the traces (matplotlib's
Figure API, ``pip install 'lit_ddp[plot]'``) and, with ``--json OUT``, every figure in microseconds.

Exit codes: 0 done; 1 no picture (matplotlib missing, or the directory not writable); 2 nothing to analyse,
in one line on stderr: no traces, a file that is not a trace, two traces of one rank, or traces without GPU
events (a CPU-only profile: there is no GPU time to break down, and zeros would be made up).
"""

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lit_ddp.analysis.tables import fmt_ms, table
from lit_ddp.analysis.trace import (
    GRADIENT,
    PHASES,
    Breakdown,
    NoGpuEvents,
    RankAnalysis,
    TraceError,
    analyze,
    combine,
    load,
)
from lit_ddp.analysis.trace import merge as merge_intervals
from lit_ddp.errors import EXIT_USAGE

PROG = "python -m lit_ddp.trace_report"
EXIT_NO_PICTURE = 1
PICTURE = "trace.png"


def fmt_us(value: float) -> str:
    """Microseconds under 1 ms, else as ``fmt_ms``."""
    return f"{value:.1f} us" if value < 1000 else fmt_ms(value / 1000)


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def find_traces(path: Path) -> list[Path]:
    """The trace files under ``path`` (see the module docstring); raises ``TraceError`` when there are none."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise TraceError(f"{path}: no such file or directory")
    found = sorted(p for pattern in ("*.pt.trace.json", "*.pt.trace.json.gz") for p in path.rglob(pattern))
    found = found or sorted(p for pattern in ("*.json", "*.json.gz") for p in path.glob(pattern))
    if not found:
        raise TraceError(f"{path}: no trace files in it (*.pt.trace.json[.gz] at any depth, or *.json[.gz])")
    return found


def load_ranks(paths: Sequence[Path]) -> list[RankAnalysis]:
    """One analysis per rank, in rank order; ``TraceError`` for a file that is not a trace, two traces of one
    rank, or traces without GPU events (all of them named in one message)."""
    traces = [load(p) for p in paths]
    by_rank = defaultdict(list)
    for trace in traces:
        by_rank[trace.rank].append(trace.path.name)
    for rank, names in sorted(by_rank.items()):
        if len(names) > 1:
            raise TraceError(f"rank {rank} has {len(names)} traces ({', '.join(names)}): keep one file per rank")
    cpu_only = sorted((t for t in traces if not t.ops), key=lambda t: t.rank)
    if cpu_only:
        which = ", ".join(f"rank {t.rank} {t.path.name}" for t in cpu_only)
        raise NoGpuEvents(f"no GPU events (kernels, memcpy, memset) in {len(cpu_only)} of {len(traces)} trace(s), "
                          f"CPU-only profiles: {which}")  # fmt: skip
    return [analyze(t) for t in sorted(traces, key=lambda t: t.rank)]


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
    """Per rank: the module docstring's figures of ``lit_ddp.analysis.trace`` over its counted steps."""
    left_out = [s.step for a in analyses for s in a.steps if not s.counted]
    note = f"; the last step ({left_out[0]}) left out, as HTA leaves it out" if left_out else ""
    rows = [(a.rank, _steps(a), *_row("", a.total)[1:]) for a in analyses]
    title = (f"GPU time per rank (union over every stream; overlap = share of communication under compute; "
             f"idle split by what ended each gap{note}):")  # fmt: skip
    text = title + "\n" + table(("rank", "steps", *_HEADER), rows)
    world = {a.world_size for a in analyses} - {None}
    if world and max(world) > len(analyses):
        text += f"\n{len(analyses)} of {max(world)} ranks' traces found: the others are not in these figures"
    return text


def phase_table(analysis: RankAnalysis) -> Optional[str]:
    """One rank's figures per phase (the ops each phase queued), summed over its counted steps; None without
    phase ranges in its trace."""
    if not analysis.phases:
        return None
    rows = [_row(p, analysis.phases[p]) for p in PHASES if p in analysis.phases]
    title = f"Per phase, rank {analysis.rank} (the GPU ops each phase's CPU range queued, steps {_steps(analysis)}):"
    return title + "\n" + table(("phase", *_HEADER), rows)


def collective_table(analysis: RankAnalysis) -> Optional[str]:
    """One rank's collectives, step by step, and each step's exposed communication; None without any."""
    if not analysis.collectives:
        return None
    rows = [(c.step if c.step is not None else "-", c.name, c.kind, "?" if c.bytes is None else f"{c.bytes:,}",
             fmt_us(c.duration_us), "-" if c.algbw_gbps is None else f"{c.algbw_gbps:.2f} GB/s",
             "-" if c.busbw_gbps is None else f"{c.busbw_gbps:.2f} GB/s") for c in analysis.collectives]  # fmt: skip
    text = (f"Collectives of rank {analysis.rank} ({len(analysis.collectives)} NCCL kernels; busbw by nccl-tests' "
            "factors for the group size):\n" + table(("step", "collective", "kind", "bytes", "time", "algbw", "busbw"),
                                                     rows))  # fmt: skip
    exposed = [f"step {s.step} {fmt_us(s.exposed_comm_us)}" + ("" if s.counted else " (not counted)")
               for s in analysis.steps if s.exposed_comm_us is not None]  # fmt: skip
    if exposed:
        text += ("\nExposed communication (gradient all-reduce time after backward's last compute kernel): "
                 + ", ".join(exposed))  # fmt: skip
    return text


def verdict(analyses: Sequence[RankAnalysis]) -> str:
    """One line: what bounds the GPUs (all ranks' figures added up) and what would help. The largest of idle
    time, compute time and communication that no compute hides decides."""
    t = combine(a.total for a in analyses)
    exposed = t.communication_us - t.overlap_us
    share = {"idle": t.idle_us, "compute": t.compute_us, "communication": exposed}
    top = max(share, key=share.get)
    of_span = {k: f"{v / t.span_us:.0%}" for k, v in share.items()}
    if top == "compute":
        return (f"Verdict: GPU-bound: compute kernels ran {of_span['compute']} of the GPUs' span; lower precision "
                "(bf16), fewer FLOPs or faster kernels would help")  # fmt: skip
    if top == "communication":
        return (
            f"Verdict: communication-bound: {of_span['communication']} of the span only communication ran; "
            "smaller DDP buckets (more overlap with backward), a bf16 compression hook or a faster link would help"
        )
    waits = f"host wait {_pct(t.host_wait_us, t.idle_us)}, kernel wait {_pct(t.kernel_wait_us, t.idle_us)}"
    if t.other_wait_us > t.host_wait_us + t.kernel_wait_us:
        return (f"Verdict: stalled: the GPUs were idle {of_span['idle']} of their span with work queued (other wait "
                f"{_pct(t.other_wait_us, t.idle_us)} of it): a slower rank or a host sync holds them back; compare "
                "the ranks' rows")  # fmt: skip
    return (f"Verdict: host-bound: the GPUs were idle {of_span['idle']} of their span ({waits} of it); larger "
            "batches per rank, fewer kernel launches (CUDA graphs, torch.compile, a fused optimizer) or less "
            "per-step Python would help")  # fmt: skip


def report(analyses: Sequence[RankAnalysis]) -> str:
    """Every table and the verdict, as printed."""
    parts = [rank_table(analyses), *(phase_table(a) for a in analyses[:1]), collective_table(analyses[0])]
    return "\n\n".join(p for p in parts if p) + "\n" + verdict(analyses)


def to_json(analyses: Sequence[RankAnalysis]) -> dict[str, Any]:
    """``{"ranks": [...]}``: per rank its totals (``lit_ddp.analysis.trace.Breakdown``'s fields), counted steps, phases,
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


COLORS = {
    "compute only": "#4C72B0", "compute + communication": "#8172B3", "communication only": "#C44E52",
    "memory only": "#55A868", "host wait": "#DDDDDD", "kernel wait": "#BBBBBB", "other wait": "#888888",
}  # fmt: skip
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "update": "#55A868"}  # "other", or no phases: grey


def plot(analyses: Sequence[RankAnalysis], out: Path) -> Path:
    """Left: each rank's span split into compute, communication, memory and the three waits. Right: the first
    counted step of each rank on the GPU, compute by phase above, collectives below (exposed part hatched)."""
    # The Figure API, not pyplot: no backend switch and no global state (works inside a notebook too).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 2.6 + 0.9 * len(analyses)))
    ax_bar, ax_line = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    for y, a in enumerate(analyses):
        t, left = a.total, 0.0
        comm_only = t.communication_us - t.overlap_us
        for label, us in (("compute only", t.compute_us - t.overlap_us), ("compute + communication", t.overlap_us),
                          ("communication only", comm_only), ("memory only", t.non_compute_us - comm_only),
                          ("host wait", t.host_wait_us), ("kernel wait", t.kernel_wait_us),
                          ("other wait", t.other_wait_us)):  # fmt: skip
            ax_bar.barh(y, us / 1e3, left=left, color=COLORS[label], label=label if y == 0 else None)
            left += us / 1e3
        _timeline(ax_line, a, y)
    for ax in (ax_bar, ax_line):
        ax.set_yticks(range(len(analyses)), [f"rank {a.rank}" for a in analyses])
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=7)
    ax_bar.set(title="GPU time over the counted steps", xlabel="ms")
    ax_line.set(title="first counted step on the GPU", xlabel="ms from the step's first GPU op")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def _timeline(ax, analysis: RankAnalysis, y: int) -> None:
    step = next((s for s in analysis.steps if s.counted), None)
    if step is None:
        return
    ops = [p for p in analysis.ops if p.step == step.step]
    t0 = min(p.op.start_us for p in ops)
    label = {"compute": True, GRADIENT: GRADIENT, "other": "other collective", "exposed": "exposed"} if y == 0 else {}
    for phase in dict.fromkeys(p.phase for p in ops):  # in order of appearance
        compute = [(p.op.start_us, p.op.end_us) for p in ops if p.phase == phase and p.op.kind == "compute"]
        ax.broken_barh([((s - t0) / 1e3, (e - s) / 1e3) for s, e in merge_intervals(compute)], (y + 0.02, 0.45),
                       color=PHASE_COLORS.get(phase, "#999999"),
                       label=f"{phase or 'compute'} compute" if label else None)  # fmt: skip
    ends = [p.op.end_us for p in ops if p.phase == "backward" and p.op.kind == "compute"]
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


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def run(path: Path, json_out: Optional[Path] = None, picture: bool = True) -> int:
    """The report of the traces under ``path``; the exit code (see the module docstring). What
    ``python -m lit_ddp.report --trace DIR [--json OUT] [--no-plot]`` calls, as ``main`` does."""
    try:
        # This report's own JSON, from an earlier run, is not a trace to refuse.
        found = [p for p in find_traces(Path(path)) if json_out is None or not _same(p, Path(json_out))]
        if not found:
            raise TraceError(f"{path}: no trace files in it, only {json_out}")
        analyses = load_ranks(found)
    except TraceError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(report(analyses))
    if json_out is not None:
        Path(json_out).write_text(json.dumps(to_json(analyses), indent=1) + "\n")
        print(f"wrote {json_out}")
    if picture:
        out = (path if Path(path).is_dir() else Path(path).parent) / PICTURE
        try:
            print(f"wrote {plot(analyses, out)}")
        except ImportError:
            print("no picture: matplotlib is missing (pip install 'lit_ddp[plot]')", file=sys.stderr)
            return EXIT_NO_PICTURE
        except OSError as err:
            print(f"no picture: {out}: {err.strerror}", file=sys.stderr)
            return EXIT_NO_PICTURE
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", type=Path, metavar="DIR", help="one trace per rank under it, or one trace file")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure (microseconds) to OUT")
    parser.add_argument("--no-plot", action="store_true", help=f"tables only, no {PICTURE}")
    args = parser.parse_args(argv)
    return run(args.trace_dir, args.json, picture=not args.no_plot)


if __name__ == "__main__":
    sys.exit(main())
