"""Per-rank torch.profiler traces -> where each GPU's time went, the collectives of each step, a verdict, a picture.

    python -m lit_ddp.trace_report runs/mini_train/version_0          # Lightning PyTorchProfiler's traces
    python -m lit_ddp.trace_report traces/ --json trace.json --no-plot

Finds the traces under DIR (``*.pt.trace.json[.gz]`` at any depth, else every ``*.json[.gz]`` in DIR, or DIR as
one trace file), prints the tables of ``lit_ddp.analysis.trace_tables``, writes ``trace.png`` beside the traces
(``pip install 'lit_ddp[plot]'``) and, with ``--json OUT``, every figure in microseconds. Exit codes: 0 done; 1
no picture; 2 nothing to analyse (one line on stderr). docs/traces.md.
"""

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lit_ddp.analysis.trace import (
    GRADIENT,
    NoGpuEvents,
    RankAnalysis,
    TraceError,
    analyze_rank,
    load,
)
from lit_ddp.analysis.trace import merge as merge_intervals
from lit_ddp.analysis.trace_tables import to_json, trace_report
from lit_ddp.errors import EXIT_USAGE

TRACE_REPORT_PROG = "python -m lit_ddp.trace_report"
EXIT_NO_PICTURE = 1
PICTURE = "trace.png"


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
    return [analyze_rank(t) for t in sorted(traces, key=lambda t: t.rank)]


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
        print(f"{TRACE_REPORT_PROG}: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(trace_report(analyses))
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
    parser = argparse.ArgumentParser(prog=TRACE_REPORT_PROG, description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", type=Path, metavar="DIR", help="one trace per rank under it, or one trace file")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure (microseconds) to OUT")
    parser.add_argument("--no-plot", action="store_true", help=f"tables only, no {PICTURE}")
    args = parser.parse_args(argv)
    return run(args.trace_dir, args.json, picture=not args.no_plot)


if __name__ == "__main__":
    sys.exit(main())
