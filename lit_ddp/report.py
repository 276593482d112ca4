"""A run's record, or anyone's profiler traces -> the summary tables and a picture: one door for what a run left.

    python -m lit_ddp.report runs/mini_train_profile/version_0
    python -m lit_ddp.report runs/mini_train_profile/version_0 --forecast 8,64,512 --link nvlink+ib400
    python -m lit_ddp.report --trace DIR --json trace.json
    python -m lit_ddp.report RUN_A --compare RUN_B                  # row by row, beyond the noise
    python -m lit_ddp.report A1 A2 A3 --compare B1 B2 B3            # several runs of each: run-to-run noise too
    python -m lit_ddp.report --flight-recorder DIR                  # why a job hung, from its ranks' dumps
    python -m lit_ddp.report runs/mini_train_profile/version_0 --timeline run.json   # every rank on one timeline

Reads ``phases.json`` (PhaseTimer) and ``comm.json`` (CommMonitor) from a run directory (``lit_ddp.records.schema``),
analyzes them once (``lit_ddp.analysis.run_analysis``), prints the same tables the callbacks print at the end of
training (``lit_ddp.present``), and writes ``phases.png`` (docs/output.md; needs matplotlib: ``pip install
'lit_ddp[plot]'``). ``--trace`` reads per-rank ``torch.profiler`` traces instead (``lit_ddp.trace_report``);
``--timeline`` writes every rank's kept steps on one clock (``lit_ddp.present.timeline``).
"""

import argparse
import pickle
import sys
from pathlib import Path

from lit_ddp.analysis.flight_recorder import flight_recorder_text
from lit_ddp.analysis.run_analysis import RunAnalysis, analyze
from lit_ddp.errors import ForecastError, RecordError, UsageParser
from lit_ddp.formatting import fmt_si, oom_line
from lit_ddp.present import forecast, plots, timeline, traces
from lit_ddp.present.compare import compare_dirs
from lit_ddp.present.end_of_fit import tables
from lit_ddp.records.runs import no_record
from lit_ddp.records.schema import load_oom, load_run
from lit_ddp.scaling.model import Measured

PROG = "python -m lit_ddp.report"


def parser(prog: str = PROG) -> UsageParser:
    """The command line (``--help``); ``prog`` names the command in its errors (an alias's own name)."""
    parser = UsageParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="*", metavar="run_dir",
                        help="a run's log directory (phases.json / comm.json); several with --compare")  # fmt: skip
    parser.add_argument("--no-plot", action="store_true", help="tables only")
    parser.add_argument("--detail", action="store_true", help="every line of the tables, those that do not change "
                        "the answer too (the ring formula, the bucket_cap note, the memory legend, ...)")  # fmt: skip
    parser.add_argument("--compare", type=Path, nargs="+", metavar="RUN_B", help="this run (or --trace) against "
                        "another's, row by row, beyond the noise; several runs of each side allow for the variation "
                        "between runs")  # fmt: skip
    group = parser.add_argument_group("profiler traces")
    group.add_argument("--trace", type=Path, metavar="DIR", help="read the per-rank torch.profiler traces under DIR")
    group.add_argument("--json", type=Path, metavar="OUT", help="with --trace: write every figure as JSON (us)")
    parser.add_argument(
        "--flight-recorder",
        type=Path,
        metavar="DIR",
        help="compare the per-rank Flight Recorder dumps in DIR (lit_ddp.analysis.flight_recorder)",
    )
    group = parser.add_argument_group("timeline")
    group.add_argument("--timeline", type=Path, metavar="FILE.json", help="write every rank of the run on one "
                       "timeline: a Chrome Trace Event file for Perfetto's UI (docs/traces.md)")  # fmt: skip
    group.add_argument("--timeline-steps", metavar="A-B", help="with --timeline: the kept steps A to B only")
    forecast.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    command = parser(prog)
    args = command.parse_args(argv)
    if len(args.run_dirs) > 1 and args.compare is None:
        command.error("several run directories go with --compare (A1 A2 --compare B1 B2)")
    args.run_dir = args.run_dirs[0] if args.run_dirs else None
    if args.flight_recorder is not None:
        return _flight_recorder(command, args.flight_recorder)
    if args.trace is not None:
        return _traces(command, args)
    if args.json is not None:
        command.error("--json goes with --trace")
    if args.run_dir is None:
        command.error("give a run directory, or --trace DIR")
    _check_run_dirs(command, (*args.run_dirs, *(args.compare or ())))
    if args.timeline is not None or args.timeline_steps is not None:
        return _timeline(command, args)
    if args.compare is not None:
        try:
            print(compare_dirs(args.run_dirs, args.compare))
        except RecordError as err:
            command.error(str(err))
        return 0
    return _run(command, args)


def _flight_recorder(command: UsageParser, folder: Path) -> int:
    if not folder.is_dir():
        command.error(f"--flight-recorder {folder}: not a directory")
    try:
        print(flight_recorder_text(folder))
    except (OSError, ValueError, pickle.UnpicklingError, KeyError) as err:
        command.error(f"--flight-recorder: {err}")
    return 0


def _traces(command: UsageParser, args: argparse.Namespace) -> int:
    if args.run_dir is not None or args.forecast:
        command.error("--trace DIR reads traces alone: give no run directory or --forecast with it")
    if args.compare is not None:
        if len(args.compare) > 1:
            command.error("--trace A --compare B takes one folder of traces on each side")
        if args.trace.resolve() == args.compare[0].resolve():
            command.error(f"{args.compare[0]} is given twice: each profile goes on one side, once")
        return traces.compare(args.trace, args.compare[0], prog=command.prog)
    return traces.run(args.trace, args.json, picture=not args.no_plot, prog=command.prog)


def _check_run_dirs(command: UsageParser, given: tuple[Path, ...]) -> None:
    for at, run_dir in enumerate(given):
        if not run_dir.is_dir():
            command.error(f"{run_dir} is not a directory")
        if any(run_dir.resolve() == earlier.resolve() for earlier in given[:at]):
            # A run against itself is a comparison of nothing, and a run counted twice on a side would narrow its
            # interval as if it were another run.
            command.error(f"{run_dir} is given twice: each run goes on one side, once")


def _run(command: UsageParser, args: argparse.Namespace) -> int:
    """Load, analyze, render."""
    try:
        phases, comm = load_run(args.run_dir)
        out_of_memory = load_oom(args.run_dir)
    except RecordError as err:
        command.error(str(err))
    for oom in out_of_memory:  # the rank's line again, from the record it wrote before the job ended
        print(oom_line(oom, str(args.run_dir / f"oom_rank{oom.rank}.json")))
    if phases is None and comm is None and out_of_memory:
        return 0  # a run that ran out of memory: its ranks' lines are its record
    if phases is None and comm is None:
        command.error(no_record(args.run_dir))
    analysis = analyze(phases, comm)
    code = 0
    if not args.forecast:  # the forecast prints its own lines only: the tables are a plain report's
        for text in tables(analysis, detail=args.detail):
            print(text)
        if phases is not None and not args.no_plot:
            code = plots.write(lambda: plots.phases_figure(analysis), args.run_dir / "phases.png")
    if args.forecast:
        try:
            code = _forecast(args, analysis) or code
        except ForecastError as err:
            command.error(str(err))
    return code


def _forecast(args: argparse.Namespace, analysis: RunAnalysis) -> int:
    def inputs() -> Measured:
        if analysis.measured is None:
            raise ForecastError(analysis.not_forecast.replace("the run", str(args.run_dir), 1))
        return analysis.measured

    code = forecast.run(args, args.run_dir, inputs)
    found = analysis.named_straggler
    if found is not None:
        # The model takes each phase from the slowest rank and models backward from the buckets' ready times
        # (before any wait): the straggler's slow phase is in every step at every N, its victims' wait is not.
        print(f"straggler: rank {found.rank} ({found.cause or 'its phases'} {found.cause_extra_ms:+.1f} ms) paces "
              f"every step above: each phase is the slowest rank's, and the others' {max(found.wait_ms):.1f} ms "
              "wait for it is not counted again")  # fmt: skip
    return code


def _timeline(command: UsageParser, args: argparse.Namespace) -> int:
    """``--timeline FILE``: the run's timeline, written; one line says where and what opens it."""
    if args.timeline is None:
        command.error("--timeline-steps goes with --timeline FILE.json")
    if args.compare is not None or args.forecast:
        command.error("--timeline draws one run: give it no --compare or --forecast")
    try:
        steps = timeline.parse_steps(args.timeline_steps) if args.timeline_steps is not None else None
        path = timeline.write_timeline(args.run_dir, args.timeline, steps)
    except (ValueError, RecordError, OSError) as err:
        command.error(str(err))
    print(f"wrote {path} ({fmt_si(path.stat().st_size, 'B')}): open it in Perfetto's UI (https://ui.perfetto.dev, "
          "Open trace file), chrome://tracing or speedscope")  # fmt: skip
    return 0


def forecast_alias(argv: list[str] | None = None) -> int:
    """``python -m lit_ddp.forecast RUN [...]`` (kept for old command lines): ``report RUN --forecast 8,64,512
    [...]``, the ranks given or these."""
    argv = sys.argv[1:] if argv is None else argv
    ranks = [] if any(a == "--forecast" or a.startswith("--forecast=") for a in argv) else ["--forecast", "8,64,512"]
    return main([*argv, *ranks], prog="python -m lit_ddp.forecast")


def trace_alias(argv: list[str] | None = None) -> int:
    """``python -m lit_ddp.trace_report DIR [--json OUT] [--no-plot]`` (kept for old command lines):
    ``report --trace DIR [...]``."""
    argv = sys.argv[1:] if argv is None else argv
    return main(["--trace", *argv], prog="python -m lit_ddp.trace_report")


if __name__ == "__main__":
    sys.exit(main())
