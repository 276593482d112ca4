"""A run's record, or anyone's profiler traces -> the summary tables and a picture.

    python -m lit_ddp.report runs/mini_train_profile/version_0
    python -m lit_ddp.report runs/mini_train_profile/version_0 --forecast 8,64,512 --link nvlink+ib400
    python -m lit_ddp.report --trace DIR --json trace.json
    python -m lit_ddp.report RUN_A --compare RUN_B                  # row by row, beyond the noise
    python -m lit_ddp.report A1 A2 A3 --compare B1 B2 B3            # several runs of each: run-to-run noise too
    python -m lit_ddp.report --flight-recorder DIR                  # why a job hung, from its ranks' dumps

Reads ``phases.json`` (PhaseTimer) and ``comm.json`` (CommMonitor) from a run directory (``lit_ddp.records.schema``),
prints the same tables the callbacks print at the end of training (``lit_ddp.analysis.phases``), and writes
``phases.png``: stacked forward / backward / update / other bars per kept step (rank 0) and a timeline of one
steady step per rank, with each bucket's all-reduce and its exposed part. With ``--trace``, reads a folder of
per-rank ``torch.profiler`` traces instead (``lit_ddp.trace_report``). The pictures need matplotlib
(``pip install 'lit_ddp[plot]'``).
"""

import pickle
import sys
from pathlib import Path

from lit_ddp import forecast, trace_report
from lit_ddp.analysis import plots
from lit_ddp.analysis.comm import comm_table
from lit_ddp.analysis.compare import compare_dirs
from lit_ddp.analysis.flight_recorder import flight_recorder_text
from lit_ddp.analysis.memory import oom_line
from lit_ddp.analysis.phases import phase_table
from lit_ddp.errors import RecordError, UsageParser
from lit_ddp.records.schema import load_oom, load_run, no_record
from lit_ddp.scaling.advice import wire_savings


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="python -m lit_ddp.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="*", metavar="run_dir",
                        help="a run's log directory (phases.json / comm.json); several with --compare")  # fmt: skip
    parser.add_argument("--no-plot", action="store_true", help="tables only")
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
    forecast.add_arguments(parser)
    args = parser.parse_args(argv)
    if len(args.run_dirs) > 1 and args.compare is None:
        parser.error("several run directories go with --compare (A1 A2 --compare B1 B2)")
    args.run_dir = args.run_dirs[0] if args.run_dirs else None
    if args.flight_recorder is not None:
        if not args.flight_recorder.is_dir():
            parser.error(f"--flight-recorder {args.flight_recorder}: not a directory")
        try:
            print(flight_recorder_text(args.flight_recorder))
        except (OSError, ValueError, pickle.UnpicklingError, KeyError) as err:
            parser.error(f"--flight-recorder: {err}")
        return 0
    if args.trace is not None:
        if args.run_dir is not None or args.forecast:
            parser.error("--trace DIR reads traces alone: give no run directory or --forecast with it")
        if args.compare is not None:
            if len(args.compare) > 1:
                parser.error("--trace A --compare B takes one folder of traces on each side")
            if args.trace.resolve() == args.compare[0].resolve():
                parser.error(f"{args.compare[0]} is given twice: each profile goes on one side, once")
            return trace_report.compare(args.trace, args.compare[0], prog=parser.prog)
        return trace_report.run(args.trace, args.json, picture=not args.no_plot, prog=parser.prog)
    if args.json is not None:
        parser.error("--json goes with --trace")
    if args.run_dir is None:
        parser.error("give a run directory, or --trace DIR")
    given = (*args.run_dirs, *(args.compare or ()))
    for at, run_dir in enumerate(given):
        if not run_dir.is_dir():
            parser.error(f"{run_dir} is not a directory")
        if any(run_dir.resolve() == earlier.resolve() for earlier in given[:at]):
            # A run against itself is a comparison of nothing, and a run counted twice on a side would narrow its
            # interval as if it were another run.
            parser.error(f"{run_dir} is given twice: each run goes on one side, once")
    if args.compare is not None:
        try:
            print(compare_dirs(args.run_dirs, args.compare))
        except RecordError as err:
            parser.error(str(err))
        return 0
    try:
        phases, comm = load_run(args.run_dir)
        out_of_memory = load_oom(args.run_dir)
    except RecordError as err:
        parser.error(str(err))
    for oom in out_of_memory:  # the rank's line again, from the record it wrote before the job ended
        print(oom_line(oom, str(args.run_dir / f"oom_rank{oom.rank}.json")))
    if phases is None and comm is None and out_of_memory:
        return 0  # a run that ran out of memory: its ranks' lines are its record
    if phases is None and comm is None:
        parser.error(no_record(args.run_dir))
    code = 0
    if not args.forecast:  # the forecast prints its own lines only: the tables are a plain report's
        if phases is not None:
            print(phase_table(phases, comm, wire_savings(args.run_dir, comm)))
        if comm is not None:
            print(comm_table(comm, phases))
        if phases is not None and not args.no_plot:
            code = plots.write(lambda: plots.phases_figure(phases, comm), args.run_dir / "phases.png")
    if args.forecast:
        try:
            code = forecast.run(args, args.run_dir) or code
        except forecast.ForecastError as err:
            parser.error(str(err))
        straggler = comm.straggler if comm is not None else None
        if straggler and straggler["rank"] is not None:
            # The model takes each phase from the slowest rank and models backward from the buckets' ready times
            # (before any wait): the straggler's slow phase is in every step at every N, its victims' wait is not.
            print(f"straggler: rank {straggler['rank']} ({straggler['cause'] or 'its phases'} "
                  f"{straggler['cause_extra_ms']:+.1f} ms) paces every step above: each phase is the slowest rank's, "
                  f"and the others' {max(straggler['wait_ms']):.1f} ms wait for it is not counted again")  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
