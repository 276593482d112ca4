"""The port against the notes' plain loop, and what each callback costs: measured tables, not tests.

    python benchmarks/step_time.py                 # 2 CPU processes (or all GPUs), dims 1024 and 4096
    python benchmarks/step_time.py --repeats 3 --dims 1024 --skip-features

How time is measured, the same way on both sides: every rank records the wall clock at the top of each step
(the reference in its loop, the port with ``StepClock`` in ``on_train_batch_start``) and once after the
last step; a step's time is the difference of consecutive marks, so it includes everything that happens
per step (forward, backward, all-reduce, update, loss printing, callbacks). The first ``--warmup`` steps
are dropped; the figure for a run is the median over steps and ranks, and the table shows the median over
``--repeats`` runs, which are interleaved (one run of every variant per round) so that slow drifts of a
shared machine hit all variants alike. Time to first step is from just before the command is started to
the first step mark of rank 0 (interpreter start, imports, launching the ranks and the rendezvous
included). Peak memory is the largest max RSS of the ranks. The plain loop (``lit_ddp.reference``, which
prints the global loss every step as the notes do) runs under torchrun, the port as ``python -m lit_ddp.fit``.
The bare port has the tool's per-step work switched off; the rows below it add one feature each, so the cost
of each is visible. The whole-run rows time a 1-step run from the command to its exit.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STEP_CLOCK = "benchmarks.step_clock.StepClock"


def child_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (what was there stays after it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}


def run(cmd: list[str], out_dir: Path) -> dict:
    """Runs one command; returns its steady per-step ms, time to first step (s) and peak RSS (MB)."""
    start = time.time()
    result = subprocess.run(cmd, cwd=out_dir, env=child_env(), capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{result.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    return {"starts": [r["step_starts"] for r in ranks], "rss": max(r["max_rss_mb"] for r in ranks),
            "first": ranks[0]["step_starts"][0] - start}  # fmt: skip


def steady_ms(starts: list[list[float]], warmup: int) -> float:
    return statistics.median(
        (b - a) * 1e3 for rank in starts for a, b in zip(rank[warmup:], rank[warmup + 1 :], strict=False)
    )


def measure_interleaved(cmds: dict, repeats: int, warmup: int) -> dict[str, dict]:
    """Runs every command once per round, ``repeats`` rounds, so slow drifts of the machine hit all alike."""
    runs: dict[str, list] = {name: [] for name in cmds}
    for _ in range(repeats):
        for name, cmd_for in cmds.items():
            with tempfile.TemporaryDirectory() as tmp:
                runs[name].append(run(cmd_for(Path(tmp)), Path(tmp)))
    out = {}
    for name, rs in runs.items():
        per_run = [steady_ms(r["starts"], warmup) for r in rs]
        out[name] = {
            "step_ms": statistics.median(per_run),
            "spread": (min(per_run), max(per_run)),
            "first_s": statistics.median(r["first"] for r in rs),
            "rss_mb": max(r["rss"] for r in rs),
        }
    return out


def reference_cmd(nproc: int, dim: int, steps: int, fused: bool = False):
    def cmd(tmp: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "-m", "lit_ddp.reference", "--dim", str(dim), "--steps", str(steps), "--timings", str(tmp),
                *(["--fused"] if fused else [])]  # fmt: skip

    return cmd


def port_cmd(nproc: int, dim: int, steps: int, *extra: str, torchrun: bool = False):
    def cmd(tmp: Path) -> list[str]:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if torchrun else []
        return [sys.executable, *launcher, "-m", "lit_ddp.fit", "--devices", str(nproc), "--model.dim", str(dim),
                "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(tmp / "runs"),
                *extra, f"--trainer.callbacks+={STEP_CLOCK}", f"--trainer.callbacks.out_dir={tmp}"]  # fmt: skip

    return cmd


def table(header: tuple, rows: list[tuple]) -> str:
    cells = [tuple(str(c) for c in row) for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in cells)  # fmt: skip


# The tool's per-step work switched off: what is left is Lightning's loop and the port's model and data.
BARE = ("--loss_monitor.every_n_steps", "0", "--loss_monitor.check_finite", "false", "--sync_check.every_n_steps", "0",
        "--sync_check.check_setup", "false", "--step_sync.sigterm_every_n_steps", "1000000")  # fmt: skip
FEATURES = {  # each on top of the bare port
    "+ LossMonitor printing every step": ("--loss_monitor.every_n_steps", "1"),
    "+ NaN check every step": ("--loss_monitor.check_finite", "true"),
    "+ SyncCheck every step": ("--sync_check.every_n_steps", "1"),
    "+ SIGTERM check every step": ("--step_sync.sigterm_every_n_steps", "1"),
    "+ PhaseTimer": ("--trainer.callbacks+=lit_ddp.callbacks.PhaseTimer", "--trainer.callbacks.print_steps=0"),
    "+ CommMonitor": ("--trainer.callbacks+=lit_ddp.callbacks.CommMonitor",),
}


def wall_s(cmd: list[str], cwd: Path) -> float:
    """Seconds from starting ``cmd`` to its exit."""
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{result.stderr.decode()[-3000:]}")
    return time.perf_counter() - start


def one_step_walls(n: int, repeats: int) -> dict[str, float]:
    """Median wall of a whole 1-step run (start-up, rendezvous, one step, exit), interleaved."""
    cmds = {
        "plain loop (torchrun)": reference_cmd(n, 1024, 1),
        "port (python -m lit_ddp.fit)": lambda tmp: [sys.executable, "-m", "lit_ddp.fit", "--devices", str(n),
                                                     "--trainer.max_steps", "1",
                                                     "--trainer.logger.init_args.save_dir", str(tmp)],
    }  # fmt: skip
    walls: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(repeats):
        for name, cmd_for in cmds.items():
            with tempfile.TemporaryDirectory() as tmp:
                walls[name].append(wall_s(cmd_for(Path(tmp)), Path(tmp)))
    return {name: statistics.median(w) for name, w in walls.items()}


def verdict(value: float, target: float) -> str:
    return f"{value:.2f}x (target <= {target:.2f}x: {'met' if value <= target else 'MISSED'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-features", action="store_true", help="only the port vs plain loop rows")
    args = parser.parse_args()
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps ({args.steps}) must exceed --warmup + 1 ({args.warmup + 1})")
    n, s, w, r = args.nproc, args.steps, args.warmup, args.repeats
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{n} processes on {device}, torch {torch.__version__}; {s} steps, first {w} dropped, median of {r} runs")

    header = ("run", "step ms (median)", "run medians min-max", "x plain loop", "first step s", "peak RSS MB")
    rows, ratios = [], {}
    for dim in args.dims:
        fast = ("--config", str(ROOT / "configs/fast.yaml"), "--model.dim", str(dim))
        variants = {
            "plain loop (torchrun)": reference_cmd(n, dim, s),
            "port, default config": port_cmd(n, dim, s),
            "port, configs/fast.yaml": port_cmd(n, dim, s, *fast),
        }
        if not args.skip_features:
            variants["port, bare (tool's per-step work off)"] = port_cmd(n, dim, s, *BARE)
            variants.update(
                {f"port, bare {name}": port_cmd(n, dim, s, *BARE, *extra) for name, extra in FEATURES.items()}
            )
        results = measure_interleaved(variants, r, w)
        ref = results["plain loop (torchrun)"]["step_ms"]
        for name, m in results.items():
            lo, hi = m["spread"]
            ratios[(name, dim)] = m["step_ms"] / ref
            rows.append((f"{name}, dim {dim}", f"{m['step_ms']:.1f}", f"{lo:.1f}-{hi:.1f}",
                         f"{m['step_ms'] / ref:.2f}", f"{m['first_s']:.1f}", f"{m['rss_mb']:.0f}"))  # fmt: skip
        print(table(header, rows[-len(results) :]), flush=True)

    walls = one_step_walls(n, r)
    print()
    print(table(header, rows))
    print("\nWhole 1-step run, command to exit (median of interleaved runs):")
    plain = walls["plain loop (torchrun)"]
    print(table(("run", "wall s", "x plain loop"), [(k, f"{v:.1f}", f"{v / plain:.2f}") for k, v in walls.items()]))
    print("\nTargets:")
    for dim, target in ((1024, 1.10), (4096, 1.05)):
        if ("port, default config", dim) in ratios:
            print(f"  default config per step, dim {dim}: {verdict(ratios[('port, default config', dim)], target)}")
    print(f"  1-step run, command to exit: {verdict(walls['port (python -m lit_ddp.fit)'] / plain, 1.10)}")
    if ("port, configs/fast.yaml", 4096) in ratios:
        print(f"  configs/fast.yaml per step, dim 4096: {verdict(ratios[('port, configs/fast.yaml', 4096)], 1.0)}")


if __name__ == "__main__":
    main()
