"""What each of the tool's callbacks costs per step, hook by hook, in µs: rank 0 of real runs, timed two ways.

    python benchmarks/callback_cost.py                    # 2 CPU ranks (or all GPUs), dim 64, 400 steps per run
    python benchmarks/callback_cost.py --dim 1024 --steps 200

Each run is ``python -m lit_ddp.fit`` with one more callback listed last, on rank 0, from the end of step
``--warmup`` to the end of the last step (whole steps only: no start-up, no end of training):

- ``HookClock``, no profiler: every per-step hook of every callback Lightning calls (and the DDP communication
  hook, the forward pre-hook, the optimizer post-hook the tool registers) is wrapped in a clock, and so are the
  named parts inside them (the gather's call, the fingerprint, the Step line, the rows for the loggers); and
  Lightning's ``_call_callback_hooks`` as a whole, whose time less the hooks' is Lightning's own dispatch of the
  callbacks (a profiler context and a call per callback and hook, overridden or not). These are the µs a step
  pays (two clock reads a wrapper on top), the table's figures.
- ``RankProfile``, cProfile: every function of the tool that Lightning or torch calls, with all it calls. cProfile's
  own cost is in every figure (it counts every Python call, some 0.5-1 µs each: a hook's figure here is two to five
  times its HookClock one); it ranks where the time goes, down to the functions no wrapper names.

The clock is the main thread's CPU time by default (``--clock cpu``): the work each hook does, which other
processes on a shared machine do not inflate (``--clock wall`` counts the time they held the core, and any wait
in a collective). The gather's own work runs on gloo's thread (or the GPU), not in these figures: what it costs the
step is ``benchmarks/step_time.py``'s to measure. The runs:

- the default config (LossMonitor printing every step with its NaN check, SyncCheck after step 0, every 50th step
  and the last, StepSync, CollectiveRecorder);
- the NaN check alone (LossMonitor ``every_n_steps 0``, SyncCheck off): LossMonitor's row is the check's cost;
- PhaseTimer and CommMonitor added to the default config (``print_steps 0``, ``kernel_steps 0``).
"""

import argparse
import cProfile
import importlib
import json
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import common  # noqa: E402

PROFILE = "benchmarks.callback_cost.RankProfile"
HOOK_CLOCK = "benchmarks.callback_cost.HookClock"
# Parts of a top-level row worth a row of their own: (file's tail, function) -> label.
PARTS = {
    ("callbacks/loss_monitor.py", "_report"): "LossMonitor's result: the NaN check, the global mean, the Step line",
    ("callbacks/loss_monitor.py", "_global_mean"): "the NaN check and the global mean (_global_mean)",
    ("callbacks/shared.py", "write"): "the Step line (line_printer's write)",
    ("callbacks/shared.py", "say"): "a line through logging (say)",
    ("callbacks/shared.py", "log_metrics"): "rows for the loggers (log_metrics)",
    ("callbacks/sync_check.py", "fingerprints"): "SyncCheck's fingerprint (fingerprints)",
    ("callbacks/sync_check.py", "_compared"): "SyncCheck's comparison of the gathered rows",
    ("callbacks/step_sync.py", "_send"): "StepSync's row and its all_gather started (_send)",
    ("callbacks/step_sync.py", "_finish"): "StepSync's gather waited for and read (_finish)",
    ("callbacks/step_sync.py", "put"): "a value into StepSync's row (put)",
    ("callbacks/phase_timer.py", "_resolve"): "PhaseTimer's window: steps resolved, logged (_resolve)",
    ("measure/fit_phases.py", "mark"): "PhaseTimer's marks (FitPhases.mark)",
    ("callbacks/comm_monitor.py", "_collect"): "CommMonitor's window: buckets to rows (_collect)",
    ("measure/collectives.py", "mark"): "the collective record's mark (CollectiveRecord.mark)",
    ("run/watchdog.py", "beat"): "the watchdog's beat (watchdog.beat)",
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


# Per-step hooks Lightning calls on callbacks; the hooks the tool registers elsewhere; named parts inside them.
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")  # fmt: skip
REGISTERED = {"PhaseTimer": ("_on_forward_start", "_on_optimizer_step_end")}  # bound at its on_train_start
METHOD_PARTS = {
    "StepSync": {"_send": "its row's gather started (_send)", "_finish": "last step's rows read, handed out (_finish)"},
    "LossMonitor": {"_report": "a printed step's result (_report)", "_global_mean": "the NaN check, the mean",
                    "_print": "the Step line", "_log": "rows for the loggers (every log_every_n_steps)"},
    "SyncCheck": {"_compared": "the gathered fingerprints compared"},
    "PhaseTimer": {"_resolve": "its window: the step before resolved, logged (_resolve)"},
    "CommMonitor": {"_collect": "its window: buckets to rows (_collect)"},
}  # fmt: skip
FUNCTION_PARTS = {  # module-level functions as their callers look them up: (module, name) -> (owner, label)
    ("lit_ddp._torch", "all_gather_started"): ("StepSync", "the all_gather started (the process group's call)"),
    ("lit_ddp.callbacks.step_sync", "all_gather"): ("StepSync", "the all_gather started (torch.distributed's call)"),
    ("lit_ddp.callbacks.sync_check", "fingerprints"): ("SyncCheck", "the fingerprint"),
    ("lit_ddp.run.watchdog", "beat"): ("CollectiveRecorder", "the watchdog's beat (a clock read at a new step)"),
}


class HookClock(Callback):
    """Rank 0 times, with no profiler, every per-step hook of the Trainer's callbacks and the named parts inside
    them, and Lightning's dispatch of the callbacks' hooks, from the end of step ``warmup`` to the end of the last
    step; writes ``out_dir/hooks.json`` (µs per step by row, and the steps). Listed last.

    Args:
        out_dir: Where rank 0 writes ``hooks.json``.
        warmup: Steps before the clocks count.
        clock: ``cpu``: the main thread's CPU time; ``wall``: ``perf_counter``.
    """

    def __init__(self, out_dir: str, warmup: int = 20, clock: str = "cpu") -> None:
        self.out_dir, self.warmup = out_dir, warmup
        self._now = time.thread_time_ns if clock == "cpu" else time.perf_counter_ns
        self._ns: dict[str, int] = {}
        self._counting = False
        self._from = 0

    def _timed(self, fn: Callable, key: str) -> Callable:
        now, ns = self._now, self._ns
        ns.setdefault(key, 0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._counting:
                return fn(*args, **kwargs)
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[key] += now() - start

        return timed

    def _wrap_method(self, obj: Any, name: str, key: str) -> None:
        if callable(getattr(obj, name, None)):
            setattr(obj, name, self._timed(getattr(obj, name), key))

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not trainer.is_global_zero:
            return
        for callback in trainer.callbacks:  # what is registered at its on_train_start, wrapped before it
            name = type(callback).__name__
            for method in REGISTERED.get(name, ()):
                self._wrap_method(callback, method, f"{name}.{method}")
            if name == "CommMonitor":
                make = callback._timed
                callback._timed = lambda hook, cast, _make=make: self._timed(
                    _make(hook, cast), "CommMonitor: its DDP comm hook"
                )
        for (module, function), (owner, label) in FUNCTION_PARTS.items():
            mod = importlib.import_module(module)
            if hasattr(mod, function):  # an older commit's code may lack it (the script is copied to compare)
                setattr(mod, function, self._timed(getattr(mod, function), f"{owner}: {label}"))
        from lightning.pytorch.trainer import call

        call._call_callback_hooks = self._timed(call._call_callback_hooks, "Lightning: every callback hook call")

    def _wrap_hooks(self, trainer: Trainer) -> None:
        """Every callback's overridden per-step hooks and named parts, at the warm-up's end: all are attached by then
        (StepSync adds CollectiveRecorder in its setup) and have set what they set at the start (LossMonitor's
        line printer)."""
        for callback in trainer.callbacks:
            name = type(callback).__name__
            if callback is self or name == "RankProfile":
                continue
            for hook in STEP_HOOKS:
                if getattr(type(callback), hook) is not getattr(Callback, hook):  # overridden: its own work
                    self._wrap_method(callback, hook, f"{name}.{hook}")
            for method, label in METHOD_PARTS.get(name, {}).items():
                self._wrap_method(callback, method, f"{name}: {label}")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not trainer.is_global_zero:
            return
        if not self._counting and trainer.global_step == self.warmup:
            self._wrap_hooks(trainer)
            self._counting, self._from, self._start = True, trainer.global_step, self._now()
        elif self._counting and trainer.global_step >= trainer.max_steps:
            self._counting = False
            steps = trainer.global_step - self._from
            result = {"steps": steps, "step_us": (self._now() - self._start) / steps / 1e3,
                      "us": {k: v / steps / 1e3 for k, v in self._ns.items()}}  # fmt: skip
            Path(self.out_dir, "hooks.json").write_text(json.dumps(result))


def hook_rows(us: dict[str, float]) -> list[tuple[str, float]]:
    """HookClock's figures as rows: each callback's hooks, their parts indented under them, Lightning's dispatch
    (every hook call less the hooks inside it) and the tool's total."""
    dispatch = us.pop("Lightning: every callback hook call", 0.0)
    hooks = {k: v for k, v in us.items() if "." in k and ":" not in k}
    parts = {k: v for k, v in us.items() if ":" in k}
    rows = []
    for owner in sorted({k.split(".")[0] for k in hooks} | {k.split(":")[0] for k in parts}):
        rows += [(k, v) for k, v in sorted(hooks.items(), key=lambda kv: -kv[1]) if k.split(".")[0] == owner]
        rows += [(f"  {k.split(': ', 1)[1]}", v) for k, v in parts.items() if k.split(":")[0] == owner]
    inside = sum(v for k, v in hooks.items())
    rows.append(("Lightning's dispatch of the callbacks' hooks (every hook call less the hooks)", dispatch - inside))
    rows.append(("the tool's hooks", sum(v for k, v in hooks.items() if not k.startswith(("HookClock", "RankProf")))))
    return rows


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


def run_with(callback: str, nproc: int, dim: int, steps: int, warmup: int, extra: tuple[str, ...], clock: str,
             tmp: str) -> None:  # fmt: skip
    """``python -m lit_ddp.fit`` with ``callback`` (a class path of this module) listed last."""
    cmd = [sys.executable, "-m", "lit_ddp.fit", *extra, "--devices", str(nproc), "--model.dim", str(dim),
           "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(Path(tmp, "runs")),
           f"--trainer.callbacks+={callback}", f"--trainer.callbacks.out_dir={tmp}",
           f"--trainer.callbacks.warmup={warmup}", f"--trainer.callbacks.clock={clock}"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp, env=common.child_env(), capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({' '.join(cmd)}):\n{result.stderr[-3000:]}")


def profile_run(nproc: int, dim: int, steps: int, warmup: int, extra: tuple[str, ...], clock: str) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        run_with(PROFILE, nproc, dim, steps, warmup, extra, clock, tmp)
        return read_profile(Path(tmp, "rank0.prof"), int(Path(tmp, "steps").read_text()))


def hook_run(nproc: int, dim: int, steps: int, warmup: int, extra: tuple[str, ...], clock: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_with(HOOK_CLOCK, nproc, dim, steps, warmup, extra, clock, tmp)
        return json.loads(Path(tmp, "hooks.json").read_text())


def watchdog_beat_line(calls: int = 200_000, repeats: int = 5) -> str:
    """The watchdog's per-step cost, timed alone (``timeit``: the wrapper HookClock puts around a call costs more
    than the call): a step's first beat (a clock read and an append) and a second one of the same step (a
    comparison: the strategy and the recorder both beat), each the median of ``repeats`` runs of ``calls``."""
    import statistics
    import timeit

    from lit_ddp.run.watchdog import Watchdog

    dog = Watchdog(0, 1)
    steps = iter(range(10**9))
    new = statistics.median(timeit.repeat(lambda: dog.beat(next(steps)), number=calls, repeat=repeats)) / calls
    again = statistics.median(timeit.repeat(lambda: dog.beat(0), number=calls, repeat=repeats)) / calls
    return (
        f"the watchdog's beats, timed alone: {(new + again) * 1e6:.2f} µs a step (a new step's {new * 1e6:.2f} "
        f"µs, the same step's again {again * 1e6:.2f} µs; wall time, median of {repeats} x {calls:,})"
    )


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
    print(f"Rank 0 ({clock}), {args.nproc} ranks on {device}, dim {args.dim}, steps {args.warmup}-{args.steps}")
    print(watchdog_beat_line())
    for name, extra in RUNS.items():
        timed = hook_run(args.nproc, args.dim, args.steps, args.warmup, extra, args.clock)
        step_us = timed["step_us"]
        print(f"\n{name}: HookClock, no profiler: {step_us:,.0f} µs per step")
        print(f"  {'row (µs per step, with what it calls)':<84} {'µs':>7} {'of step':>7}")
        for label, us in hook_rows(timed["us"]):
            if us >= args.min_us or label == "the tool's hooks":
                print(f"  {label:<84} {us:7.1f} {us / step_us:7.1%}")
        rows, parts, step_us = profile_run(args.nproc, args.dim, args.steps, args.warmup, extra, args.clock)
        print(f"{name}: cProfile, {step_us:,.0f} µs per step under it")
        print(f"  {'row (µs per step, with what it calls)':<84} {'µs':>7}")
        for label, us in rows:
            if us >= args.min_us:
                print(f"  {label:<84} {us:7.1f}")
        print(f"  {'total':<84} {sum(us for _, us in rows):7.1f}")
        for label, us in parts:
            if us >= args.min_us:
                print(f"    {label:<82} {us:7.1f}")


if __name__ == "__main__":
    main()
