"""How often the noise model's words are wrong, on real runs here: measured tables, not tests.

    nice -n 10 python benchmarks/noise.py                 # 5 runs of 3 workloads, then the slowed runs (2-15 min)
    nice -n 10 python benchmarks/noise.py --repeats 3 --delays 10 --out /tmp/noise
    python benchmarks/noise.py --reuse --out /tmp/noise      # the tables again from the runs already made

Every run is ``python -m lit_ddp.fit`` with PhaseTimer and CommMonitor, 40 steps (``--steps``), in a fresh process,
one workload after the other in each round (so that the machine's drift falls on all alike). Three tables:

1. **A/A**: every pair of the repeated runs of one workload, ``report A --compare A'`` (``lit_ddp.present.compare``):
   the share of rows called ``slower`` or ``faster`` (each row's interval holds for the family of rows at 95%, so
   at most 5% of pairs should have any row called, and fewer of the rows).
2. **Detection**: the first workload with every rank's forward ``d`` ms longer (``--delays``), each run against
   each of the undelayed runs: the share of pairs whose forward row is called ``slower``, and the median
   difference measured.
3. **Several runs per side**: the same two questions with ``report A1 A2 --compare B1 B2``
   (``compare.many_rows``: the runs' medians, their variation between runs included): every split of a
   workload's runs into two disjoint groups of ``--group`` runs, and the slowed runs (as one group) against every
   group of as many plain runs.
4. **The verdict** of each run (``lit_ddp.present.phases.verdict``), as it begins, and the straggler named, per
   workload: 5 runs of one workload should say one thing.
"""

import argparse
import itertools
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import ROOT, child_env  # noqa: E402, F401
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.derive import stragglers
from lit_ddp.formatting import table
from lit_ddp.present import compare
from lit_ddp.present.phases import verdict
from lit_ddp.records.schema import load_run


class Workload(NamedTuple):
    name: str
    args: tuple[str, ...]


WORKLOADS = (
    Workload("linear 256, 2 ranks", ("--devices", "2", "--model.dim", "256")),
    Workload("linear 1024, 2 ranks", ("--devices", "2", "--model.dim", "1024")),
    Workload(
        "linear 256, 3 ranks, rank 1 +25 ms in backward",
        (
            "--devices",
            "3",
            "--model.dim",
            "256",
            "--model.slow_rank",
            "1",
            "--model.phase",
            "backward",
            "--model.delay_ms",
            "25",
        ),
    ),  # fmt: skip
)


def fit(out: Path, name: str, steps: int, *args: str, reuse: bool = False) -> Path:
    """One run of ``python -m lit_ddp.fit``, logged under ``out/name``; its run directory (``reuse``: the one
    already there, if it holds a record)."""
    if reuse and (out / name / "version_0" / "phases.json").is_file():
        return out / name / "version_0"
    command = [sys.executable, "-m", "lit_ddp.fit", "--trainer.accelerator", "cpu", "--model",
               "tests.slow_ranks.SlowRegression", "--model.delay_ms", "0", "--trainer.max_steps", str(steps),
               "--loss_monitor.every_n_steps", "0", "--trainer.callbacks+=lit_ddp.callbacks.PhaseTimer",
               "--trainer.callbacks+=lit_ddp.callbacks.CommMonitor", "--trainer.logger",
               "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(out),
               "--trainer.logger.name", name, "--trainer.logger.version", "0", *args]  # fmt: skip
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300, check=False)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stderr[-2000:]}")
    return out / name / "version_0"


def splits(runs: list[Path], k: int) -> list[tuple[tuple[Path, ...], tuple[Path, ...]]]:
    """Every way to take two disjoint groups of ``k`` of ``runs`` (each unordered pair of groups once)."""
    found = []
    for a in itertools.combinations(runs, k):
        rest = [r for r in runs if r not in a]
        found += [(a, b) for b in itertools.combinations(rest, k) if runs.index(a[0]) < runs.index(b[0])]
    return found


def several(args: argparse.Namespace, runs: dict[str, list[Path]], delayed: dict[float, list[Path]],
            records: dict) -> str:  # fmt: skip
    """The A/A and detection tables with several runs per side (``compare.many_rows``)."""
    rows = []
    for w in WORKLOADS:
        pairs = splits(runs[w.name], args.group)
        called = [[r.word for r in compare.many_rows([records[p] for p in a], [records[p] for p in b])]
                  for a, b in pairs]  # fmt: skip
        n_rows = sum(len(c) for c in called)
        wrong = sum(word != "same" for c in called for word in c)
        any_row = sum(any(word != "same" for word in c) for c in called)
        rows.append((w.name, len(pairs), n_rows, f"{wrong} ({wrong / max(1, n_rows):.1%})",
                     f"{any_row} ({any_row / max(1, len(pairs)):.0%})"))  # fmt: skip
    text = (f"\nA/A, several runs per side: every split of {args.repeats} runs into two groups of {args.group}, "
            f"report A1 A2 --compare B1 B2:\n")  # fmt: skip
    text += table(("workload", "pairs", "rows", "rows called slower/faster", "pairs with any row called"), rows)
    rows = []
    for d, slowed in delayed.items():
        groups = list(itertools.combinations(runs[WORKLOADS[0].name], len(slowed)))
        found, sizes = 0, []
        for base in groups:
            (row,) = [r for r in compare.many_rows([records[p] for p in base], [records[p] for p in slowed])
                      if r.name == "forward"]  # fmt: skip
            found += row.word == "slower"
            sizes.append(row.difference.estimate)
        n = len(groups)
        rows.append((f"+{d:g} ms", n, f"{found} ({found / max(1, n):.0%})",
                     f"{sorted(sizes)[len(sizes) // 2]:+.2f} ms" if sizes else "-"))  # fmt: skip
    k = len(next(iter(delayed.values()), []))
    text += (f"\n\nDetection, several runs per side: the {k} slowed runs of each d against every group of {k} plain "
             "ones:\n")  # fmt: skip
    return text + table(("forward", "pairs", "forward called slower", "median B - A"), rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each workload (5)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (40)")
    parser.add_argument("--delays", default="2,5,10", help="forward slowdowns to detect, ms (2,5,10)")
    parser.add_argument("--delayed-runs", type=int, default=3, help="runs of each slowdown (3)")
    parser.add_argument("--group", type=int, default=2, help="runs per side in the several-runs A/A (2)")
    parser.add_argument("--out", type=Path, default=Path("noise_runs"), help="where the runs go (./noise_runs)")
    parser.add_argument("--reuse", action="store_true", help="read the runs already in --out instead of rerunning")
    args = parser.parse_args(argv)
    delays = [float(d) for d in args.delays.split(",") if d]
    start = time.perf_counter()
    runs: dict[str, list[Path]] = {w.name: [] for w in WORKLOADS}
    delayed: dict[float, list[Path]] = {d: [] for d in delays}
    for i in range(args.repeats):  # interleaved: one run of each workload per round
        for k, w in enumerate(WORKLOADS):
            runs[w.name].append(fit(args.out, f"w{k}_r{i}", args.steps, *w.args, reuse=args.reuse))
        if i < args.delayed_runs:
            for d in delays:
                slowed = (*WORKLOADS[0].args, "--model.slow_rank", "null", "--model.phase", "forward",
                          "--model.delay_ms", f"{d:g}")  # fmt: skip
                delayed[d].append(fit(args.out, f"d{d:g}_r{i}", args.steps, *slowed, reuse=args.reuse))
    records = {path: load_run(path) for path in [*itertools.chain(*runs.values()), *itertools.chain(*delayed.values())]}

    rows = []
    for w in WORKLOADS:
        pairs = list(itertools.combinations(runs[w.name], 2))
        called = [[r.word for r in compare.run_rows(records[a], records[b])] for a, b in pairs]
        n_rows = sum(len(c) for c in called)
        wrong = sum(word != "same" for c in called for word in c)
        any_row = sum(any(word != "same" for word in c) for c in called)
        rows.append(
            (w.name, len(pairs), n_rows, f"{wrong} ({wrong / n_rows:.1%})", f"{any_row} ({any_row / len(pairs):.0%})")
        )
    print(f"A/A: every pair of {args.repeats} runs of each workload, {args.steps} steps each:")
    print(table(("workload", "pairs", "rows", "rows called slower/faster", "pairs with any row called"), rows))

    rows = []
    for d in delays:
        found, sizes = 0, []
        for slow, base in itertools.product(delayed[d], runs[WORKLOADS[0].name]):
            (row,) = [r for r in compare.run_rows(records[base], records[slow]) if r.name == "forward"]
            found += row.word == "slower"
            sizes.append(row.difference.estimate)
        n = len(delayed[d]) * len(runs[WORKLOADS[0].name])
        rows.append((f"+{d:g} ms", n, f"{found} ({found / n:.0%})", f"{sorted(sizes)[len(sizes) // 2]:+.2f} ms"))
    print(
        f"\nDetection: {WORKLOADS[0].name}, every rank's forward d ms longer, each slowed run against each plain one:"
    )
    print(table(("forward", "pairs", "forward called slower", "median B - A"), rows))

    print(several(args, runs, delayed, records))

    rows = []
    for w in WORKLOADS:
        said = []
        for path in runs[w.name]:
            phases, comm = records[path]
            line = (
                verdict(analyze(phases, comm)).removeprefix("Verdict: ").removeprefix("a CPU run (no device to idle): ")
            )
            found = stragglers.find_straggler(comm, phases)
            said.append((line.split(":")[0].split(",")[0], found.rank if found else None))
        for (what, rank), count in Counter(said).most_common():
            rows.append((w.name, f"{count} of {len(said)}", what, "-" if rank is None else f"rank {rank}"))
    print(f"\nThe verdict of each run (as it begins), {args.repeats} runs of each workload:")
    print(table(("workload", "runs", "verdict", "straggler"), rows))
    print(f"\n{len(records)} runs in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
