"""The hang zoo: every case run as a user would run it, each with a timeout, and the table of what was named.

    python -m benchmarks.hang_zoo                          # every case once (the multi-node ones as root)
    python -m benchmarks.hang_zoo --cases rank1_sleeps,sync_dist_keys --repeat 3
    python -m benchmarks.hang_zoo --list                   # the cases, their threads and what names them

Columns: ``named rank/line/cause`` says, for each, whether the job's output showed it (all three on one line is
"named"; the check is ``benchmarks.hang_zoo.expect``); ``named s``: seconds from the hang's start (the case's mark)
to that line; ``exit s``: from the hang's start to the job's exit (a healthy case: its whole run); ``code``: the
job's exit code ("killed": still running at the timeout + 60 s, and killed); ``left``: its processes still running
5 s after it exited, found by scanning /proc for its session (then killed). With ``--repeat`` the seconds are
medians and a flag says in how many runs it held.
"""

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

import lightning
import torch

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.run import Case, Result, cluster, load, names, run_case
from lit_ddp.formatting import table

HEADER = ("case", "thread", "named rank/line/cause", "named s", "exit s", "code", "left")
NAMED_WITHIN_S, CERTAIN_ENDS_WITHIN_S = 15.0, 20.0  # issue 48's acceptance, on 2 CPU ranks


def flag(values: list) -> str:
    if all(v is None for v in values):
        return "-"
    held = sum(bool(v) for v in values)
    return "yes" if held == len(values) else "no" if held == 0 else f"{held}/{len(values)}"


def seconds(values: list) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.1f}".replace("-0.0", "0.0") if values else "-"


def row(case: Case, results: list[Result]) -> tuple[str, ...]:
    verdicts = [r.verdict for r in results]
    if isinstance(case.expect, Hang):
        named = "/".join(flag([getattr(v, part) for v in verdicts]) for part in ("rank", "line", "cause"))
    else:
        problems = [p for v in verdicts for p in v.problems]
        named = f"healthy: {problems[0][:40]}" if problems else "healthy: ok"
    codes = sorted({"killed" if r.code is None else str(r.code) for r in results})
    return (case.name, case.thread or "-", named, seconds([r.named_s() for r in results]),
            seconds([r.exit_s() for r in results]), ",".join(codes), str(max(r.left for r in results)))  # fmt: skip


def ended_within(results: list[Result], limit_s: float) -> bool:
    """Every run ended within ``limit_s`` of its hang's start, non-zero (or 0 where the tool avoids the hang)."""
    zero_ok = results[0].case.expect.avoidable
    return all(r.code is not None and (r.code != 0 or zero_ok) and r.exit_s() <= limit_s for r in results)


def summary(results: dict[str, list[Result]], timeout_s: float) -> list[str]:
    hangs = {n: rs for n, rs in results.items() if isinstance(rs[0].case.expect, Hang)}
    healthy = {n: rs for n, rs in results.items() if n not in hangs}
    named = [n for n, rs in hangs.items() if all(r.verdict.named_at is not None for r in rs)]
    fast = [n for n in named if all(r.named_s() <= NAMED_WITHIN_S for r in hangs[n])]
    certain = [n for n, rs in hangs.items() if rs[0].case.expect.certain]
    ended = [n for n in certain if ended_within(hangs[n], CERTAIN_ENDS_WITHIN_S)]
    bounded = [n for n, rs in hangs.items() if ended_within(rs, timeout_s + 15)]
    ok = [n for n, rs in healthy.items() if not any(r.verdict.problems for r in rs)]
    left = [n for n, rs in results.items() if any(r.left for r in rs)]
    return [f"hangs named (rank, line and cause on one line): {len(named)} of {len(hangs)}; within "
            f"{NAMED_WITHIN_S:g} s of the start: {len(fast)}",
            f"certain divergences ended within {CERTAIN_ENDS_WITHIN_S:g} s of the start: {len(ended)} of "
            f"{len(certain)}",
            f"hangs ended by the timeout ({timeout_s:g} s) + 15 s, non-zero or avoided: {len(bounded)} of {len(hangs)}",
            f"healthy cases ending 0 with no hang word: {len(ok)} of {len(healthy)}",
            f"cases that left a process running: {len(left)}" + (f" ({', '.join(left)})" if left else "")]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hang_zoo", description=__doc__.splitlines()[0])
    p.add_argument("--cases", help="comma-separated case names (default: all; see --list)")
    p.add_argument("--skip", default="", help="comma-separated case names to leave out")
    p.add_argument("--repeat", type=int, default=1, help="runs of each case")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=60,
        help="the process group's timeout each job sets (the "
        "rendezvous' too: a rank that takes longer to start never joins)",
    )
    p.add_argument("--logs", type=Path, help="write each case's whole output to LOGS/<case>.log")
    p.add_argument("--list", action="store_true", help="list the cases and what must name them, and exit")
    args = p.parse_args(argv)
    known = names()
    chosen = args.cases.split(",") if args.cases else known
    skip = set(filter(None, args.skip.split(",")))
    if unknown := [c for c in [*chosen, *skip] if c not in known]:
        p.error(f"unknown case(s) {unknown}; choose from {known}")
    if args.repeat < 1 or args.timeout_s <= 0:
        p.error(f"--repeat must be >= 1 and --timeout-s > 0, got {args.repeat} and {args.timeout_s:g}")
    cases = [load(name) for name in chosen if name not in skip]
    if args.list:
        print(table(("case", "thread", "must be named by"), [(c.name, c.thread or "-", str(c.expect)) for c in cases]))
        return
    on_nodes = [c for c in cases if c.nodes]
    if on_nodes and (os.geteuid() != 0 or shutil.which("ip") is None):
        print(f"leaving out {[c.name for c in on_nodes]}: the namespace nodes need root and iproute2", file=sys.stderr)
        cases = [c for c in cases if not c.nodes]
        on_nodes = []
    results: dict[str, list[Result]] = {}
    try:
        if on_nodes:
            cluster("start", "2")
        for case in cases:
            for _ in range(args.repeat):
                result = run_case(case, args.timeout_s, args.logs)
                results.setdefault(case.name, []).append(result)
                print(f"{case.name}: exit {result.code}, named {result.verdict.text[:150] or '-'}", file=sys.stderr)
    finally:
        if on_nodes:
            cluster("stop")
    print(f"Hang zoo, 2 CPU ranks, timeout {args.timeout_s:g} s, torch {torch.__version__}, lightning "
          f"{lightning.__version__}, {args.repeat} run(s) per case:")  # fmt: skip
    print(table(HEADER, [row(load(name), rs) for name, rs in results.items()], left=3))
    print("\n".join(summary(results, args.timeout_s)))


if __name__ == "__main__":
    main()
