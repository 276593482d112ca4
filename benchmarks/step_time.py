"""The port against the notes' plain loop, and what each callback costs: measured tables, not tests.

    python benchmarks/step_time.py                 # 2 CPU processes (or all GPUs), dims 1024 and 4096
    python benchmarks/step_time.py --repeats 5 --steps 40

How time is measured, the same way on both sides: every rank records the wall clock at the top of each step
(the reference in its loop, the port with ``StepClock`` in ``on_train_batch_start``) and once after the
last step; a step's time is the difference of consecutive marks, so it includes everything that happens
per step (forward, backward, all-reduce, update, loss printing, callbacks). The first ``--warmup`` steps
are dropped; the figure for a run is the median over steps and ranks, and the table shows the median over
``--repeats`` runs, which are interleaved (one run of every variant per round) so that slow drifts of a
shared machine hit all variants alike. Time to first step is from just before the command is started to
the first step mark of rank 0 (interpreter start, imports, launching the ranks and the rendezvous
included). Peak memory is the largest max RSS of the ranks. The reference runs under torchrun, the port as
``python -m lit_ddp.fit`` (Lightning's launcher) and under torchrun.
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


def run(cmd: list[str], out_dir: Path) -> dict:
    """Runs one command; returns its steady per-step ms, time to first step (s) and peak RSS (MB)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.time()
    result = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=600)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-callbacks", action="store_true", help="only the port vs reference table")
    args = parser.parse_args()
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps ({args.steps}) must exceed --warmup + 1 ({args.warmup + 1})")
    n, s, w, r = args.nproc, args.steps, args.warmup, args.repeats
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{n} processes on {device}, torch {torch.__version__}; {s} steps, first {w} dropped, median of {r} runs")

    header = ("run", "step ms (median)", "run medians min-max", "x reference", "first step s", "peak RSS MB")
    rows = []
    for dim in args.dims:
        fast = ("--config", str(ROOT / "configs/fast.yaml"), "--model.dim", str(dim))
        results = measure_interleaved({"reference (torchrun)": reference_cmd(n, dim, s),
                                       "port, default config": port_cmd(n, dim, s),
                                       "port, default config, torchrun": port_cmd(n, dim, s, torchrun=True),
                                       "port, configs/fast.yaml": port_cmd(n, dim, s, *fast)}, r, w)  # fmt: skip
        ref = results["reference (torchrun)"]["step_ms"]
        for name, m in results.items():
            lo, hi = m["spread"]
            rows.append((f"{name}, dim {dim}", f"{m['step_ms']:.1f}", f"{lo:.1f}-{hi:.1f}",
                         f"{m['step_ms'] / ref:.2f}", f"{m['first_s']:.1f}", f"{m['rss_mb']:.0f}"))  # fmt: skip
        print(table(header, rows[-len(results) :]), flush=True)

    print()
    print(table(header, rows))
    if args.skip_callbacks:
        return

    dim = max(args.dims)
    quiet = ("--trainer.callbacks=[]", "--loss_monitor.every_n_steps", "0", "--loss_monitor.check_finite", "false")
    timer = ("--trainer.callbacks+=lit_ddp.callbacks.PhaseTimer", "--trainer.callbacks.print_steps=0")
    comm = ("--trainer.callbacks+=lit_ddp.callbacks.CommMonitor",)
    callbacks = {
        "no callbacks": (),
        "PhaseTimer": timer,
        "CommMonitor": comm,
        "PhaseTimer + CommMonitor": (*timer, *comm),
        "SyncCheck every step": ("--trainer.callbacks+=lit_ddp.callbacks.SyncCheck",),
        "LossMonitor every step": ("--loss_monitor.every_n_steps", "1", "--loss_monitor.check_finite", "true"),
    }
    results = measure_interleaved({name: port_cmd(n, dim, s, *quiet, *extra) for name, extra in callbacks.items()},
                                  r, w)  # fmt: skip
    base = results["no callbacks"]["step_ms"]
    cost_rows = []
    for name, m in results.items():
        lo, hi = m["spread"]
        delta = m["step_ms"] - base
        cost_rows.append((name, f"{m['step_ms']:.1f}", f"{lo:.1f}-{hi:.1f}", f"{delta:+.1f}", f"{delta / base:+.1%}"))
    print(f"\nCallback cost, dim {dim} (the profile config's model), port with everything else off:")
    print(table(("callbacks on", "step ms (median)", "run medians min-max", "delta ms", "delta"), cost_rows))


if __name__ == "__main__":
    main()
