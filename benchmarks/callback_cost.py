"""What each of the tool's callbacks costs per step, hook by hook: cProfile of rank 0 of real runs, in µs per step.

    python benchmarks/callback_cost.py                    # 2 CPU ranks (or all GPUs), dim 64, 400 steps per run
    python benchmarks/callback_cost.py --dim 1024 --steps 200

Each run is ``python -m lit_ddp.fit`` with ``RankProfile`` added last to its callbacks: rank 0 runs under
``cProfile`` from the end of step ``--warmup`` to the end of the last step, so the profile holds whole steps only
(no start-up, no end of training). A row is one function of the tool that Lightning or torch calls (a
callback's hook, a module hook, a DDP communication hook, a future's callback): its time per step with all it
calls, from those callers only; indented rows are named parts of it (the Step line inside LossMonitor's result,
the fingerprint inside SyncCheck's hook, the gather inside StepSync's). ``total`` is every top-level row of the
run; ``step`` is the profiled time per step, the model and Lightning's loop included. The runs:

- the default config (LossMonitor printing every step with its NaN check, SyncCheck every step, StepSync,
  CollectiveRecorder);
- the NaN check alone (LossMonitor ``every_n_steps 0``, SyncCheck off): LossMonitor's row is the check's cost;
- PhaseTimer and CommMonitor added to the default config (``print_steps 0``, ``kernel_steps 0``).

The clock is the main thread's CPU time by default (``--clock cpu``): the work each hook does, which other
processes on a shared machine do not inflate (``--clock wall`` counts the time they held the core, and any wait
in a collective). cProfile's own cost is in every figure (some 0.5-1 µs per Python call): the rows rank where
the time goes and compare before/after a change; the step times to read against bare Lightning are
``benchmarks/step_time.py``'s.
"""

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common  # noqa: E402

PROFILE = "benchmarks.callback_cost.RankProfile"
# Parts of a top-level row worth a row of their own: (file's tail, function) -> label.
PARTS = {
    ("callbacks/loss_monitor.py", "report"): "LossMonitor's result: the NaN check, the global mean, the Step line",
    ("callbacks/shared.py", "say"): "the Step line (say)",
    ("callbacks/shared.py", "log_metrics"): "rows for the loggers (log_metrics)",
    ("callbacks/sync_check.py", "fingerprints"): "SyncCheck's fingerprint (fingerprints)",
    ("callbacks/sync_check.py", "compare"): "SyncCheck's comparison of the gathered rows",
    ("callbacks/step_sync.py", "_send"): "StepSync's row and its all_gather started (_send)",
    ("callbacks/step_sync.py", "_finish"): "StepSync's gather waited for and read (_finish)",
    ("callbacks/step_sync.py", "put"): "a value into StepSync's row (put)",
    ("callbacks/phase_timer.py", "_resolve"): "PhaseTimer's window: steps resolved, logged (_resolve)",
    ("measure/fit_phases.py", "mark"): "PhaseTimer's marks (FitPhases.mark)",
    ("callbacks/comm_monitor.py", "_collect"): "CommMonitor's window: buckets to rows (_collect)",
    ("measure/collectives.py", "mark"): "the collective record's mark (CollectiveRecord.mark)",
}
RUNS = {
    "default config": (),
    "NaN check alone": ("--loss_monitor.every_n_steps", "0", "--sync_check.every_n_steps", "0",
                        "--sync_check.check_setup", "false"),
    "default + PhaseTimer + CommMonitor": ("--trainer.callbacks+=lit_ddp.callbacks.PhaseTimer",
                                           "--trainer.callbacks.print_steps=0", "--trainer.callbacks.kernel_steps=0",
                                           "--trainer.callbacks+=lit_ddp.callbacks.CommMonitor"),
}  # fmt: skip


class RankProfile(Callback):
    """Rank 0 profiles whole steps: from the end of step ``warmup`` to the end of the last step, and writes
    ``out_dir/rank0.prof`` and ``out_dir/steps`` (how many steps the profile holds). Listed last, its batch end
    comes after every other callback's.

    Args:
        out_dir: Where rank 0 writes its profile.
        warmup: Steps before the profile starts.
        clock: ``cpu``: the main thread's CPU time (``time.thread_time``: what the hooks cost in work, the same on
            a loaded machine, a wait in a collective not counted); ``wall``: ``perf_counter`` (waits and the
            time other processes held the core included).
    """

    def __init__(self, out_dir: str, warmup: int = 20, clock: str = "cpu") -> None:
        self.out_dir, self.warmup, self.clock = out_dir, warmup, clock
        self._profile: cProfile.Profile | None = None
        self._from = 0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not trainer.is_global_zero:
            return
        if self._profile is None and trainer.global_step == self.warmup:
            timer = time.thread_time if self.clock == "cpu" else time.perf_counter
            self._profile, self._from = cProfile.Profile(timer), trainer.global_step
            self._profile.enable()
        elif self._profile is not None and trainer.global_step >= trainer.max_steps:
            self._profile.disable()
            self._profile.dump_stats(str(Path(self.out_dir, "rank0.prof")))
            Path(self.out_dir, "steps").write_text(str(trainer.global_step - self._from))


# The strategy's methods that run the user's step (the model's forward, its backward, the optimizer): the step
# itself, not the tool's work on top of it.
STEP_ITSELF = {"training_step", "backward", "optimizer_step"}


def _tool(filename: str) -> bool:
    """A file of the tool's own, not the lab's model (the user's code in a real run)."""
    parts = Path(filename).parts
    return "lit_ddp" in parts and "lab" not in parts


def _outside(filename: str) -> bool:
    """A caller outside the tool: Lightning's, torch's (a builtin, ``next`` or ``map``, tells nothing: its own
    caller may be the tool's)."""
    return filename != "~" and not _tool(filename)


def _label(filename: str, name: str) -> str:
    tail = "/".join(Path(filename).parts[-2:])
    return f"{tail.removesuffix('.py')}:{name}"


def read_profile(path: Path, steps: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]], float]:
    """The top-level rows (µs per step, largest first), the named parts, and the profiled µs per step."""
    stats = pstats.Stats(str(path)).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    top: dict[str, float] = {}
    parts: dict[str, float] = {}
    for (filename, _, name), (_, _, _, ct, callers) in stats.items():
        if not _tool(filename) or (filename.endswith("run/strategy.py") and name in STEP_ITSELF):
            continue
        outside = sum(c[3] for (f, _, _), c in callers.items() if _outside(f))  # cumulative time from those callers
        if callers and all(f == "~" for f, _, _ in callers) and not name.startswith("<"):
            outside = ct  # called from C++ only: DDP's communication hook, a future's callback
        if outside > 0:
            key = _label(filename, name)
            top[key] = top.get(key, 0.0) + outside
        for (tail, fn), label in PARTS.items():
            if filename.endswith(tail) and name == fn:
                parts[label] = parts.get(label, 0.0) + ct
    total_s = max(ct for *_, ct, _ in stats.values())  # the outermost frame: everything profiled
    per_step = 1e6 / steps
    rows = sorted(((k, v * per_step) for k, v in top.items()), key=lambda kv: -kv[1])
    return rows, [(k, v * per_step) for k, v in parts.items()], total_s * per_step


def profile_run(nproc: int, dim: int, steps: int, warmup: int, extra: tuple[str, ...], clock: str) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "lit_ddp.fit", *extra, "--devices", str(nproc), "--model.dim", str(dim),
               "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(Path(tmp, "runs")),
               f"--trainer.callbacks+={PROFILE}", f"--trainer.callbacks.out_dir={tmp}",
               f"--trainer.callbacks.warmup={warmup}", f"--trainer.callbacks.clock={clock}"]  # fmt: skip
        result = subprocess.run(cmd, cwd=tmp, env=common.child_env(), capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{result.stderr[-3000:]}")
        return read_profile(Path(tmp, "rank0.prof"), int(Path(tmp, "steps").read_text()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/callback_cost.py", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--min-us", type=float, default=1.0, help="leave out rows under this many µs per step")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the main thread's CPU time (steady on a shared machine); wall: perf_counter",
    )
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    clock = "the main thread's CPU time" if args.clock == "cpu" else "wall time"
    print(f"cProfile of rank 0 ({clock}), {args.nproc} ranks on {device}, dim {args.dim}, steps {args.warmup}-"
          f"{args.steps}")  # fmt: skip
    for name, extra in RUNS.items():
        rows, parts, step_us = profile_run(args.nproc, args.dim, args.steps, args.warmup, extra, args.clock)
        print(f"\n{name}: {step_us:,.0f} µs per step under cProfile")
        print(f"  {'row (µs per step, with what it calls)':<72} {'µs':>7}")
        for label, us in rows:
            if us >= args.min_us:
                print(f"  {label:<72} {us:7.1f}")
        print(f"  {'total':<72} {sum(us for _, us in rows):7.1f}")
        for label, us in parts:
            if us >= args.min_us:
                print(f"    {label:<70} {us:7.1f}")


if __name__ == "__main__":
    main()
