"""The port against the notes' plain loop and a bare Lightning loop, and what each callback costs: measured
tables, not tests.

    python benchmarks/step_time.py                 # 2 CPU processes (or all GPUs): dim 64, then dims 1024 and 4096
    python benchmarks/step_time.py --repeats 3 --dims 1024 --skip-features --host-dim 0
    python benchmarks/step_time.py --check         # default config vs bare Lightning at dim 64: exit 1 over 1.10x

How time is measured, the same way on every side: every rank records the wall clock at the top of each step
(the plain loop in its loop, the Lightning runs with ``benchmarks.common.StepClock`` in ``on_train_batch_start``)
and once after the last step; a step's time is the difference of consecutive marks, so it includes everything
that happens per step (forward, backward, all-reduce, update, loss printing, callbacks, Lightning's loop). The
first ``--warmup`` steps are dropped; the figure for a run is the median over steps and ranks, and the table
shows the median over ``--repeats`` runs, which are interleaved (one run of every variant per round) so that
slow drifts of a shared machine hit all variants alike. Ratios are against the baseline measured in the same
invocation, median against median. Time to first step is from just before the command is started to the first
step mark of rank 0 (interpreter start, imports, launching the ranks and the rendezvous included); run wall is
from the same start to the command's exit (the median over the repeats), the outside view of the same runs.
Peak memory is the largest max RSS of the ranks.

The runs. The plain loop is ``lit_ddp.reference`` under torchrun (it prints the global loss every step, as the
notes do). The bare Lightning loop (``benchmarks/bare_lightning.py``) is the same model, data and optimizer in
a plain ``LightningModule`` under ``Trainer(strategy="ddp")``, with no tool code at all and Lightning's
logger, checkpointing, progress bar and model summary off. The port runs as ``python -m lit_ddp.fit``: its
default config, and bare, with the tool's per-step work switched off; the rows below the bare port add one
feature each, so the cost of each is visible.

The blocks. First the host-bound regime, ``--host-dim`` (64) for ``--host-steps`` steps: a step is a few
milliseconds of Python and a small all-reduce, so what the frameworks do per step is most of it; it holds the
plain loop, the bare Lightning loop, the port's default and the bare port, with ratios against the plain loop
and against the bare Lightning loop (what Lightning costs, and what the tool adds on top). Then each of
``--dims``, with bare Lightning and the feature rows; at each of ``--floor-dims`` (4096) also the physical floor
(``benchmarks/step_floor.py``: forward, backward, one all-reduce, fused Adam, each timed alone). Last, a whole
1-step run of each from the command to its exit, issue 36's targets (each ratio with its 95% interval from the
runs, the noise model of the tool's own verdicts: met or MISSED only when the whole interval is on one side of
the target), and each callback's µs per step
(``benchmarks/callback_cost.py``; ``--skip-callbacks`` leaves it out). ``--check`` runs only the default config
and bare Lightning at the host-bound dim and exits 1 when the first is over 1.10x the second: a guard to run by
hand (docs/performance.md), not in CI.
"""

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import callback_cost, common  # noqa: E402
from lit_ddp.derive import noise  # noqa: E402
from lit_ddp.formatting import table  # noqa: E402

Command = Callable[[Path], list[str]]  # the command of one run, given its scratch directory
PLAIN = "plain loop (torchrun)"
LIGHTNING = "bare Lightning loop (no tool code)"
DEFAULT = "port, default config"
FAST = "port, configs/fast.yaml"
BARE = "port, bare (tool's per-step work off)"
# The tool's per-step work switched off: what is left is Lightning's loop and the port's model and data.
BARE_ARGS = ("--loss_monitor.every_n_steps", "0", "--loss_monitor.check_finite", "false",
             "--sync_check.every_n_steps", "0", "--sync_check.check_setup", "false",
             "--step_sync.sigterm_every_n_steps", "1000000")  # fmt: skip
FEATURES = {  # each on top of the bare port
    "+ LossMonitor printing every step": ("--loss_monitor.every_n_steps", "1"),
    "+ NaN check every step": ("--loss_monitor.check_finite", "true"),
    "+ SyncCheck every step": ("--sync_check.every_n_steps", "1"),
    "+ SIGTERM check every step": ("--step_sync.sigterm_every_n_steps", "1"),
    "+ PhaseTimer": ("--trainer.callbacks+=lit_ddp.callbacks.PhaseTimer", "--trainer.callbacks.print_steps=0"),
    "+ CommMonitor": ("--trainer.callbacks+=lit_ddp.callbacks.CommMonitor",),
}
FLOOR_PARTS = ("forward", "backward", "allreduce", "update")
CHECK_LIMIT = 1.10  # --check: the default config over bare Lightning at dim 64, at most
CONFIDENCE = 0.95  # the targets' intervals
HEADER = ("run", "step ms (median)", "run medians min-max", "x plain loop", "first step s", "run wall s",
          "peak RSS MB")  # fmt: skip


class Floor(NamedTuple):
    """``benchmarks/step_floor.py``'s step, ms: each part timed alone."""

    forward: float
    backward: float
    allreduce: float  # one all-reduce of every gradient
    update: float  # fused Adam, gradients zeroed
    plain_ms: float  # the plain loop's step in the same block

    @property
    def total(self) -> float:
        """The floor where DDP overlaps the all-reduce with the backward (a model of several layers, buckets that
        are ready while the backward goes on)."""
        return self.forward + max(self.backward, self.allreduce) + self.update

    @property
    def serial(self) -> float:
        """The floor of the notes' one ``Linear``: its weight's gradient, the one large bucket, is ready only when
        the backward ends, so no all-reduce can overlap it, on any hardware."""
        return self.forward + self.backward + self.allreduce + self.update

    @property
    def over_plain(self) -> float:
        return common.ratio(self.total, self.plain_ms)


class Run(NamedTuple):
    """One run: each rank's step start marks, and its times seen from outside."""

    starts: list[list[float]]
    first_s: float  # command start to rank 0's first step mark
    wall_s: float  # command start to its exit
    rss_mb: float  # the largest peak RSS of the ranks


class Measured(NamedTuple):
    """A variant over its repeated runs: medians, and the spread of the runs' step medians."""

    step_ms: float
    low_ms: float
    high_ms: float
    first_s: float
    wall_s: float
    rss_mb: float
    samples: list[list[float]]  # each run's steps (ms), in time order: for the noise model
    walls: list[float]  # each run's wall time, s


def run(cmd: list[str], out_dir: Path) -> Run:
    start = time.time()
    result = subprocess.run(cmd, cwd=out_dir, env=common.child_env(), capture_output=True, text=True, timeout=600)
    wall = time.time() - start
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{result.stderr[-3000:]}")
    ranks = common.read_rank_files(out_dir)
    return Run([r["step_starts"] for r in ranks], ranks[0]["step_starts"][0] - start, wall,
               max(r["max_rss_mb"] for r in ranks))  # fmt: skip


def measure_interleaved(cmds: dict[str, Command], repeats: int, warmup: int) -> dict[str, Measured]:
    """Runs every command once per round, ``repeats`` rounds, so slow drifts of the machine hit all alike."""
    runs: dict[str, list[Run]] = {name: [] for name in cmds}
    for _ in range(repeats):
        for name, cmd_for in cmds.items():
            with tempfile.TemporaryDirectory() as tmp:
                runs[name].append(run(cmd_for(Path(tmp)), Path(tmp)))
    out = {}
    for name, rs in runs.items():
        per_run = [common.steady_step_ms(r.starts, warmup) for r in rs]
        first, wall = (common.median(getattr(r, f) for r in rs) for f in ("first_s", "wall_s"))
        samples = [common.step_samples_ms(r.starts, warmup) for r in rs]
        out[name] = Measured(common.median(per_run), min(per_run), max(per_run), first, wall, max(r.rss_mb for r in rs),
                             samples, [r.wall_s for r in rs])  # fmt: skip
    return out


def ratio_interval(base: Measured, other: Measured, confidence: float = CONFIDENCE) -> noise.Interval:
    """``other``'s step over ``base``'s with its interval: the noise model of the tool's own verdicts on the log
    step times, several runs a side (``noise.runs_difference_interval``: the runs' medians, each widened by what
    its own steps show), back as a ratio (of the runs' geometric mean medians)."""
    # A step of 0 or less is the wall clock set back between two marks, not a time: left out.
    logs = [[[math.log(x) for x in run if x > 0] for run in m.samples] for m in (base, other)]
    d = noise.runs_difference_interval(*logs, confidence=confidence)
    return noise.Interval(math.exp(d.estimate), math.exp(d.low), math.exp(d.high))


def reference_cmd(nproc: int, dim: int, steps: int) -> Command:
    def cmd(tmp: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "-m", "lit_ddp.reference", "--dim", str(dim), "--steps", str(steps), "--timings", str(tmp)]  # fmt: skip

    return cmd


def lightning_cmd(nproc: int, dim: int, steps: int) -> Command:
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"

    def cmd(tmp: Path) -> list[str]:
        return [sys.executable, "-m", "benchmarks.bare_lightning", "--devices", str(nproc), "--accelerator",
                accelerator, "--dim", str(dim), "--steps", str(steps), "--timings", str(tmp)]  # fmt: skip

    return cmd


def port_cmd(nproc: int, dim: int, steps: int, *extra: str) -> Command:
    """``python -m lit_ddp.fit``; a ``--config`` in ``extra`` goes first (config files apply before options)."""

    def cmd(tmp: Path) -> list[str]:
        return [sys.executable, "-m", "lit_ddp.fit", *extra, "--devices", str(nproc), "--model.dim", str(dim),
                "--trainer.max_steps", str(steps), *common.clock_args(tmp)]  # fmt: skip

    return cmd


def block_rows(dim: int, results: dict[str, Measured], baselines: tuple[str, ...]) -> list[tuple]:
    """One row per variant: its figures and its step time over each baseline's."""
    num = common.fmt_num
    rows = []
    for name, m in results.items():
        ratios = (num(common.ratio(m.step_ms, results[b].step_ms), 2) for b in baselines)
        rows.append((f"{name}, dim {dim}", num(m.step_ms, 2), f"{num(m.low_ms, 2)}-{num(m.high_ms, 2)}", *ratios,
                     num(m.first_s, 1), num(m.wall_s, 1), num(m.rss_mb, 0)))  # fmt: skip
    return rows


def verdict(ratio: noise.Interval, target: float) -> str:
    """Met or missed only beyond the runs' noise: the whole interval on one side of the target. The estimate is
    ``ratio_interval``'s (of the runs' mean log medians), which a run far off moves more than the table's ratio of
    medians: the two can differ."""
    word = "met" if ratio.high <= target else "MISSED" if ratio.low > target else "can't tell at this noise"
    if not (math.isfinite(ratio.low) and math.isfinite(ratio.high)):  # too few runs or steps (noise.MIN_SAMPLES)
        return f"{ratio.estimate:.2f}x over the runs (too few runs for an interval; target <= {target:.2f}x: {word})"
    return (f"{ratio.estimate:.2f}x over the runs ({CONFIDENCE:.0%} interval {ratio.low:.2f}-{ratio.high:.2f}; "
            f"target <= {target:.2f}x: {word})")  # fmt: skip


def floor_ms(nproc: int, dim: int, steps: int, warmup: int, repeats: int, plain_ms: float) -> Floor:
    """``benchmarks/step_floor.py``'s parts (ms, the median over ranks and steps of each run, then over runs)."""
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   "-m", "benchmarks.step_floor", "--dim", str(dim), "--steps", str(steps), "--out", tmp]  # fmt: skip
            result = subprocess.run(cmd, cwd=tmp, env=common.child_env(), capture_output=True, text=True, timeout=600)
            if result.returncode != 0:
                sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{result.stderr[-3000:]}")
            ranks = common.read_rank_files(Path(tmp))
            runs.append([common.median(s[part] for r in ranks for s in r["steps"][warmup:]) for part in FLOOR_PARTS])
    return Floor(*(common.median(run[i] for run in runs) for i in range(len(FLOOR_PARTS))), plain_ms)


def check(args: argparse.Namespace) -> int:
    """``--check``: the default config against bare Lightning at the host-bound dim, in this invocation alone; 1
    when it is over ``CHECK_LIMIT``."""
    d, hs = args.host_dim or 64, args.host_steps
    variants = {LIGHTNING: lightning_cmd(args.nproc, d, hs), DEFAULT: port_cmd(args.nproc, d, hs)}
    results = measure_interleaved(variants, args.repeats, args.warmup)
    value = common.ratio(results[DEFAULT].step_ms, results[LIGHTNING].step_ms)
    interval = ratio_interval(results[LIGHTNING], results[DEFAULT])
    print(table((*HEADER[:3], "x bare Lightning"), [(f"{name}, dim {d}", f"{m.step_ms:.2f}",
                f"{m.low_ms:.2f}-{m.high_ms:.2f}", f"{common.ratio(m.step_ms, results[LIGHTNING].step_ms):.2f}")
                for name, m in results.items()]))  # fmt: skip
    ok = value <= CHECK_LIMIT
    noisy = "" if interval.low > CHECK_LIMIT or interval.high <= CHECK_LIMIT else "; within the noise: run it again"
    print(f"check: default config per step, dim {d}: medians {value:.2f}x (limit {CHECK_LIMIT:.2f}x: "
          f"{'passed' if ok else 'FAILED'}); the runs: {verdict(interval, CHECK_LIMIT)}{noisy}")  # fmt: skip
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/step_time.py", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--host-dim", type=int, default=64, help="the host-bound block's dim (0: no such block)")
    parser.add_argument("--host-steps", type=int, default=200, help="steps of each host-bound run")
    parser.add_argument("--dims", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument(
        "--floor-dims",
        type=int,
        nargs="*",
        default=[4096],
        help="the dims of --dims whose block measures the physical floor (benchmarks/step_floor.py)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-features", action="store_true", help="only the port vs plain loop rows")
    parser.add_argument("--skip-callbacks", action="store_true",
                        help="no per-callback table (benchmarks/callback_cost.py) at the end")  # fmt: skip
    parser.add_argument("--check", action="store_true",
                        help=f"only the default config against bare Lightning at --host-dim: exit 1 when it is over "
                             f"{CHECK_LIMIT:.2f}x (a guard to run by hand, not in CI)")  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("steps", "host_steps"):
        if getattr(args, name) <= args.warmup + 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must exceed --warmup + 1 "
                         f"({args.warmup + 1})")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    n, s, w, r = args.nproc, args.steps, args.warmup, args.repeats
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{n} processes on {device}, torch {torch.__version__}; first {w} steps dropped, median of {r} runs; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    if args.check:
        sys.exit(check(args))
    # (run, dim) -> its step over the plain loop's, over bare Lightning's: with the runs' interval
    ratios: dict[tuple[str, int], noise.Interval] = {}
    over_lightning: dict[tuple[str, int], noise.Interval] = {}
    floors: dict[int, Floor] = {}

    header = (*HEADER[:4], "x bare Lightning", *HEADER[4:])
    if args.host_dim:
        d, hs = args.host_dim, args.host_steps
        variants = {PLAIN: reference_cmd(n, d, hs), LIGHTNING: lightning_cmd(n, d, hs), DEFAULT: port_cmd(n, d, hs),
                    BARE: port_cmd(n, d, hs, *BARE_ARGS)}  # fmt: skip
        results = measure_interleaved(variants, r, w)
        print(f"\nHost-bound regime: dim {d}, {hs} steps per run:")
        print(table(header, block_rows(d, results, (PLAIN, LIGHTNING))), flush=True)
        over_lightning.update({(name, d): ratio_interval(results[LIGHTNING], m) for name, m in results.items()})

    for dim in args.dims:
        fast = ("--config", str(common.ROOT / "configs/fast.yaml"))
        variants = {PLAIN: reference_cmd(n, dim, s), LIGHTNING: lightning_cmd(n, dim, s), DEFAULT: port_cmd(n, dim, s),
                    FAST: port_cmd(n, dim, s, *fast)}  # fmt: skip
        if not args.skip_features:
            variants[BARE] = port_cmd(n, dim, s, *BARE_ARGS)
            variants.update({f"port, bare {name}": port_cmd(n, dim, s, *BARE_ARGS, *extra)
                             for name, extra in FEATURES.items()})  # fmt: skip
        results = measure_interleaved(variants, r, w)
        ratios.update({(name, dim): ratio_interval(results[PLAIN], m) for name, m in results.items()})
        over_lightning.update({(name, dim): ratio_interval(results[LIGHTNING], m) for name, m in results.items()})
        print(f"\n{s} steps per run:\n" + table(header, block_rows(dim, results, (PLAIN, LIGHTNING))), flush=True)
        if dim in args.floor_dims:
            plain = results[PLAIN].step_ms
            floor = floors[dim] = floor_ms(n, dim, s, w, r, plain)
            print(f"Physical floor at dim {dim} (benchmarks/step_floor.py, each part alone, median of {r} runs): "
                  f"forward {floor.forward:.2f} ms + max(backward {floor.backward:.2f}, one all-reduce "
                  f"{floor.allreduce:.2f}) + fused Adam {floor.update:.2f} = {floor.total:.2f} ms, "
                  f"{floor.over_plain:.2f}x the plain loop; fast.yaml is {results[FAST].step_ms / floor.total:.2f}x "
                  f"the floor. The notes' one Linear cannot overlap its all-reduce (its one large bucket is ready when "
                  f"the backward ends): its parts in turn take {floor.serial:.2f} ms, "
                  f"{common.ratio(floor.serial, plain):.2f}x the plain loop, and fast.yaml "
                  f"{results[FAST].step_ms / floor.serial:.2f}x that", flush=True)  # fmt: skip

    one_step = {PLAIN: reference_cmd(n, 1024, 1), LIGHTNING: lightning_cmd(n, 1024, 1), DEFAULT: port_cmd(n, 1024, 1)}
    one = measure_interleaved(one_step, r, w)
    print("\nWhole 1-step run at dim 1024, command to exit (median of interleaved runs):")
    plain = one[PLAIN].wall_s
    print(table(("run", "wall s", "x plain loop"), [(k, f"{m.wall_s:.1f}", f"{m.wall_s / plain:.2f}")
                                                    for k, m in one.items()]))  # fmt: skip
    print("\nTargets (issue 36):")
    for dim, target in ((args.host_dim, 1.05), (1024, 1.02)):
        if (DEFAULT, dim) in over_lightning:
            print(f"  default config per step over bare Lightning, dim {dim}: "
                  f"{verdict(over_lightning[(DEFAULT, dim)], target)}")  # fmt: skip
    if (BARE, args.host_dim) in over_lightning:
        print(f"  bare port per step over bare Lightning, dim {args.host_dim}: "
              f"{verdict(over_lightning[(BARE, args.host_dim)], 1.0)}")  # fmt: skip
    if (FAST, 4096) in ratios:
        floor = ""
        if 4096 in floors:
            f = floors[4096]
            serial = common.ratio(f.serial, f.plain_ms)
            floor = f"; the physical floor alone is {f.over_plain:.2f}x, the one Linear's parts in turn {serial:.2f}x"
        print(
            f"  configs/fast.yaml per step over the plain loop, dim 4096: {verdict(ratios[(FAST, 4096)], 0.5)}{floor}"
        )
    walls = noise.ratio_interval(one[PLAIN].walls, one[DEFAULT].walls, confidence=CONFIDENCE)  # one sample a run
    print(f"  1-step run, command to exit: {verdict(walls, 1.10)}")
    if not args.skip_callbacks:
        print("\nEach callback's µs per step (benchmarks/callback_cost.py):", flush=True)
        callback_cost.main(["--nproc", str(n), "--dim", str(args.host_dim or 64)])


if __name__ == "__main__":
    main()
