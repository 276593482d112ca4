"""Per-rank torch.profiler traces -> where each GPU's time went, the collectives of each step, a verdict, a picture.

    python -m lit_ddp.report --trace runs/mini_train/version_0          # Lightning PyTorchProfiler's traces
    python -m lit_ddp.report --trace traces/ --json trace.json --no-plot

Finds the traces under DIR (``*.pt.trace.json[.gz]`` at any depth, else every ``*.json[.gz]`` in DIR, or DIR as
one trace file), prints the tables of ``lit_ddp.present.trace_tables``, writes ``trace.png`` beside the traces
(``pip install 'lit_ddp[plot]'``) and, with ``--json OUT``, every figure in microseconds. Exit codes: 0 done
(without matplotlib too); 1 no picture (its folder not writable); 2 nothing to analyse (one line on stderr).
docs/traces.md.
"""

import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lit_ddp.derive.trace import (
    NoGpuEvents,
    RankAnalysis,
    TraceError,
    analyze_rank,
    load,
)
from lit_ddp.errors import EXIT_USAGE
from lit_ddp.present import plots
from lit_ddp.present.compare import compare_traces
from lit_ddp.present.trace_tables import to_json, trace_report

TRACE_REPORT_PROG = "python -m lit_ddp.report"
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


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def run(path: Path, json_out: Optional[Path] = None, picture: bool = True, prog: str = TRACE_REPORT_PROG) -> int:
    """The report of the traces under ``path``; the exit code (see the module docstring). What
    ``python -m lit_ddp.report --trace DIR [--json OUT] [--no-plot]`` calls, as ``main`` does; ``prog`` begins an
    error's line."""
    try:
        # This report's own JSON, from an earlier run, is not a trace to refuse.
        found = [p for p in find_traces(Path(path)) if json_out is None or not _same(p, Path(json_out))]
        if not found:
            raise TraceError(f"{path}: no trace files in it, only {json_out}")
        analyses = load_ranks(found)
    except TraceError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(trace_report(analyses))
    if json_out is not None:
        Path(json_out).write_text(json.dumps(to_json(analyses), indent=1) + "\n")
        print(f"wrote {json_out}")
    if picture:
        out = (path if Path(path).is_dir() else Path(path).parent) / PICTURE
        return plots.write(lambda: plots.trace_figure(analyses), out)
    return 0


def compare(path_a: Path, path_b: Path, prog: str = TRACE_REPORT_PROG) -> int:
    """Two profiles of one job, row by row (``lit_ddp.present.compare``): what ``python -m lit_ddp.report --trace
    A --compare B`` calls; the exit code as ``run``'s."""
    try:
        a, b = (load_ranks(find_traces(Path(p))) for p in (path_a, path_b))
    except TraceError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"A: {path_a}\nB: {path_b}\n{compare_traces(a, b)}")
    return 0
