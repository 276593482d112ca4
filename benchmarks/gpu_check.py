"""The GPU session: what a lent GPU is asked, in one bounded device call. It has not yet run on a GPU.

    python benchmarks/gpu_check.py fetch             # here: the wheels the GPU image lacks, into .whl/ (git-ignored)
    python benchmarks/gpu_check.py run "$OUT"        # there, in one device call carrying .whl (timeout_s 380)
    python benchmarks/gpu_check.py run "$OUT" --only syncs,suite   # a rerun of some steps
    python benchmarks/gpu_check.py check NAME OUT    # one check alone: profile, events, syncs, flight

``run`` unpacks .whl/ into /tmp/site, then runs each step (``STEPS``) in its own process group with a time limit,
its output in OUT/NAME.log and one line in OUT/summary.txt (exit code, seconds): nvidia-smi, the GPU tests, the
checks, the default suite. A step is cut to what is left of ``BUDGET_S`` and skipped under ``MIN_STEP_S``: the
whole run fits a 380 s call, twice in a session's 15 minutes. A check prints its figures and ends with one line,
``NAME: OK|MISSED|REPORTED ...``, exit 1 when missed. Without a CUDA device ``run`` and ``check`` exit 2 with one
line, before anything else. Files for tests/data land in OUT: the profile config's 2-step trace and a Flight
Recorder dump.
"""

import argparse
import gzip
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import ROOT, child_env, median, ratio  # noqa: E402

WHEELS = ("jsonargparse==4.53.0", "docstring-parser==0.18.0", "typeshed-client==2.15.0")  # the versions tested here
SITE = Path("/tmp/site")  # where run unpacks them (the GPU machine reaches no network)
BUDGET_S = 360  # the whole run; a device call of timeout_s 380 holds it with the wheels' unpacking
GRACE_S = 5  # a step that ignores SIGTERM at its limit is killed this much later
MIN_STEP_S = 10
LIMIT = 0.05  # "agree": PhaseTimer's GPU-busy time and the trace's own kernels
PROFILED = 2  # the profile config's profiled steps, cut from 3 to 2: a smaller trace for tests/data
SYNC_FIRST, SYNC_STEPS = 11, 10  # after DDP's first 10 iterations (its reducer waits for their events, unseen)
PYTEST = (sys.executable, "-m", "pytest", "-p", "no:cacheprovider")


class Step(NamedTuple):
    name: str
    limit_s: int
    command: tuple[str, ...]


def check_command(name: str, out: Path) -> tuple[str, ...]:
    return (sys.executable, str(Path(__file__).resolve()), "check", name, str(out))


def steps(out: Path) -> list[Step]:
    """The session, the GPU tests first; the limits with their grace add up to ``BUDGET_S``."""
    return [
        Step("nvidia-smi", 10, ("nvidia-smi",)),
        Step("gpu-tests", 120, (*PYTEST, "-m", "slow or not slow", "-k", "cuda or gpu", "-n", "2", "-rA")),
        *(Step(name, limit, check_command(name, out)) for name, (limit, _) in CHECKS.items()),
        Step("suite", 70, (*PYTEST, "-n", "12", "-rfEs")),
    ]


def bounded(command: Sequence[str], limit_s: float, log: Path, env: Optional[dict] = None) -> int:
    """``command`` in a process group of its own, output to ``log``; at ``limit_s`` the group gets SIGTERM, then
    SIGKILL ``GRACE_S`` later, and the exit code is 124 (as ``timeout``'s). The group is ended either way."""
    with log.open("wb") as f:
        try:
            process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as err:
            f.write(f"{type(err).__name__}: {err}\n".encode())
            return 127
        try:
            code = process.wait(limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            code = 124
        try:
            os.killpg(process.pid, signal.SIGKILL)  # what the step left behind (pytest's workers, a fit's ranks)
        except ProcessLookupError:
            pass
        process.wait()
    return code


def run_step(step: Step, out: Path, deadline: float, clock: Callable[[], float] = time.monotonic) -> str:
    """Runs ``step`` cut to the time left before ``deadline`` (its grace kept), skipped under ``MIN_STEP_S``;
    appends and returns its summary line."""
    left = deadline - clock()
    limit = min(step.limit_s, int(left - GRACE_S))
    if limit < MIN_STEP_S:
        line = f"gpu_check: {step.name}: skipped, {max(left, 0):.0f} s of the budget left"
    else:
        start = clock()
        code = bounded(step.command, limit, out / f"{step.name}.log", env=child_env())
        line = f"gpu_check: {step.name}: exit {code} after {clock() - start:.0f} s (limit {limit} s)"
    print(line, flush=True)
    with (out / "summary.txt").open("a") as f:
        f.write(line + "\n")
    return line


def run(out: Path, only: Optional[set[str]]) -> int:
    deadline = time.monotonic() + BUDGET_S
    out.mkdir(parents=True, exist_ok=True)
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if wheels:
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)]  # fmt: skip
        subprocess.run(install, check=True, timeout=60)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONUNBUFFERED"] = "1"
    probe = subprocess.run([sys.executable, "-c", "import jsonargparse"], env=child_env(), capture_output=True)
    if probe.returncode:
        print("gpu_check: error: jsonargparse is missing: run `python benchmarks/gpu_check.py fetch` here first",
              file=sys.stderr)  # fmt: skip
        return 1
    lines = [run_step(s, out, deadline) for s in steps(out) if only is None or s.name in only]
    return 0 if all(" exit 0 " in line for line in lines) else 1


# ------------------------------------------------------------------------------------------------- the checks


def fit_args(config: Path) -> list[str]:
    return [sys.executable, "-m", "lit_ddp.fit", "--config", str(config), "--devices", "1",
            "--trainer.accelerator", "gpu"]  # fmt: skip


def gpu_activity(events: Iterable[dict[str, Any]]) -> tuple[list[tuple[float, float]], list[tuple[int, float, float]]]:
    """A Chrome trace's GPU work (kernels, copies, memsets) and PhaseTimer's steps as kineto draws them on the GPU
    timeline (``lit_ddp.step#N`` user annotations, from their first GPU op to their last), in ms, steps in order.
    Read without the correlation ids and launch times that ``lit_ddp.derive.trace`` (so PhaseTimer) uses."""
    from lit_ddp.records.ranges import STEP_PREFIX

    spans = [(e, e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events if e.get("ph") == "X" and "dur" in e]
    work = [(s, t) for e, s, t in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sorted((int(e["name"].removeprefix(STEP_PREFIX)), s, t) for e, s, t in spans
                   if e.get("cat") == "gpu_user_annotation" and e["name"].startswith(STEP_PREFIX))  # fmt: skip
    return work, steps


def profile_run(out: Path) -> Path:
    return out / "profile_run" / "mini_train_profile" / "version_0"


def check_profile(out: Path) -> str:
    """The profile config on one GPU, profiling 2 steps, 30 steps (steady ones after DDP's first 10): its trace kept
    as OUT/profile_rank0.pt.trace.json.gz, and PhaseTimer's GPU-busy time of the profiled steps against the union
    of the same trace's kernels between the steps' GPU annotations: the same quantity, read another way."""
    import yaml

    from lit_ddp.maths.intervals import union_length
    from lit_ddp.records.schema import load_run

    config = yaml.safe_load((ROOT / "configs" / "mini_train_profile.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["kernel_steps"] = PROFILED
    config["trainer"]["max_steps"] = SYNC_FIRST + SYNC_STEPS
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(out / "profile_run")
    (out / "profile.yaml").write_text(yaml.safe_dump(config))
    subprocess.run(fit_args(out / "profile.yaml"), env=child_env(), check=True, timeout=CHECKS["profile"][0] - 5)
    written = profile_run(out) / "traces" / "rank0.pt.trace.json.gz"
    kept = out / "profile_rank0.pt.trace.json.gz"
    kept.write_bytes(written.read_bytes())
    work, steps = gpu_activity(json.loads(gzip.decompress(kept.read_bytes()))["traceEvents"])
    phases, _ = load_run(profile_run(out))
    timer_ms = sum(row.ms.step for row in phases.ranks[0].busy_ms)
    print(f"trace: {kept.stat().st_size:,} bytes gzipped, {len(work)} GPU ops, steps on the GPU timeline "
          f"{[s for s, _, _ in steps]}; PhaseTimer's profiled steps {phases.profiled_steps}")  # fmt: skip
    if not steps or not phases.ranks[0].busy_ms:
        return "profile: MISSED, no step annotation on the GPU timeline or no busy_ms in the record"
    union = union_length(work, steps[0][1], steps[-1][2])
    off = ratio(timer_ms, union) - 1
    verdict = "OK" if abs(off) <= LIMIT else "MISSED"
    return (f"profile: {verdict}, PhaseTimer's GPU-busy {timer_ms:.3f} ms vs the trace's kernel union "
            f"{union:.3f} ms over steps {steps[0][0]}-{steps[-1][0]} ({off:+.1%}, limit {LIMIT:.0%})")  # fmt: skip


def synchronized_phases(steps: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median forward, backward and update ms of a plain loop on the profile config's model, batch and optimizer,
    DDP over a 1-rank group, each phase between two ``synchronize()`` + ``perf_counter`` (no sync on cpu, where
    only this code is exercised). ``zero_grad`` is outside the phases, as in PhaseTimer."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lit_ddp import LinearRegression
    from lit_ddp.lab.data import shard

    cuda = device.type == "cuda"
    sync, dim = (torch.cuda.synchronize, 4096) if cuda else ((lambda: None), 64)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = LinearRegression(dim=dim).to(device)
        model = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
        optimizer = module.configure_optimizers()
        x, y = (t.to(device) for t in shard(dim, 32, seed=0, rank=0, world_size=1))
        times = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            loss = ((model(x) - y) ** 2).mean()
            sync()
            t1 = time.perf_counter()
            optimizer.zero_grad()
            sync()
            t2 = time.perf_counter()
            loss.backward()
            sync()
            t3 = time.perf_counter()
            optimizer.step()
            sync()
            times.append({"forward": t1 - t0, "backward": t3 - t2, "update": time.perf_counter() - t3})
        del model, optimizer  # DDP's reducer goes while its process group is alive
    finally:
        dist.destroy_process_group()
    return {phase: median(t[phase] * 1e3 for t in times[warmup:]) for phase in times[0]}


def check_events(out: Path) -> str:
    """PhaseTimer's CUDA-event phases (the profile run's steady steps from step 11) against the same phases of a
    plain loop timed with ``synchronize()``. Reported, not judged: events hold the GPU's idle gaps between the
    marks, the synchronized loop the launches and the synchronize itself; they agree where the GPU is the bound."""
    from lit_ddp.records.schema import load_run

    phases, _ = load_run(profile_run(out))
    if phases is None:
        return "events: MISSED, no record of the profile check's run to read"
    steady = [row for row in phases.steady_rows(0) if row.step >= SYNC_FIRST]
    synced = synchronized_phases(30, 5, torch.device("cuda", 0))
    parts = []
    for phase, sync_ms in synced.items():
        events_ms = median(row.ms[phase] for row in steady)
        print(f"{phase:<9} CUDA events {events_ms:8.3f} ms   synchronized {sync_ms:8.3f} ms")
        parts.append(f"{phase} {ratio(events_ms, sync_ms):.2f}x")
    return f"events: REPORTED, CUDA events / synchronized over {len(steady)} steady steps: " + ", ".join(parts)


class SyncCounter:
    """A callback: host syncs per step over steps ``SYNC_FIRST`` .. ``SYNC_FIRST + SYNC_STEPS - 1``, from
    ``torch.cuda.set_sync_debug_mode("warn")``'s warnings, each as ``file:line`` (a sync inside backward shows at
    the ``backward()`` call; torch.distributed's own syncs are not covered: torch's docs)."""

    def __init__(self) -> None:
        self.per_step: list[list[str]] = []
        self._catcher: Any = None
        self._log: list = []

    def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
        import warnings

        step = trainer.global_step
        if self._catcher is not None:
            self.per_step.append([f"{w.filename}:{w.lineno}" for w in self._log if "synchronizing" in str(w.message)])
            self._log.clear()
            if step == SYNC_FIRST + SYNC_STEPS:
                self.close()
        elif step == SYNC_FIRST:
            self._catcher = warnings.catch_warnings(record=True)
            self._log = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def close(self, *_: Any) -> None:
        if self._catcher is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catcher.__exit__(None, None, None)
            self._catcher = None

    on_train_end = on_exception = close


def counted_fit(print_every: int) -> list[list[str]]:
    """One in-process fit of the profile config's model on one GPU (PhaseTimer and CommMonitor on, SyncCheck at the
    end only, LossMonitor printing every ``print_every`` steps, 0 never): the host syncs of each counted step."""
    import tempfile

    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer

    from lit_ddp import FixedBatchDataModule, LinearRegression
    from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, SyncCheck
    from lit_ddp.run.strategy import LitDDPStrategy

    counter = type("Counter", (SyncCounter, Callback), {})()  # a Callback here: Lightning loads after the refusal
    callbacks = [counter, PhaseTimer(print_steps=0, kernel_steps=0), CommMonitor(),
                 LossMonitor(every_n_steps=print_every, check_finite=False), SyncCheck(every_n_steps=0)]  # fmt: skip
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trainer = Trainer(accelerator="gpu", devices=1, strategy=LitDDPStrategy(), callbacks=callbacks,
                              max_steps=SYNC_FIRST + SYNC_STEPS + 1, default_root_dir=tmp, logger=False,
                              enable_progress_bar=False, enable_model_summary=False,
                              enable_checkpointing=False)  # fmt: skip
            trainer.fit(LinearRegression(dim=4096), FixedBatchDataModule(dim=4096, batch_size=32))
        finally:
            counter.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()  # Lightning's MASTER_ADDR, LOCAL_RANK, ... are not the next fit's
            os.environ.update(env)
    return counter.per_step


def check_syncs(out: Path) -> str:
    """No host sync per steady step with the tool's per-step work on and the loss not printed (docs/performance.md);
    and the counter is shown to work: printing the loss every step adds exactly one (StepSync's host read)."""
    quiet, printing = counted_fit(0), counted_fit(1)
    for label, per_step in (("quiet", quiet), ("printing", printing)):
        print(f"{label}: syncs per step {[len(s) for s in per_step]}; sites {sorted(set(sum(per_step, [])))}")
    extra = [len(p) - len(q) for q, p in zip(quiet, printing, strict=False)]
    if len(quiet) < SYNC_STEPS or set(extra) != {1}:
        return f"syncs: MISSED, the counter is not shown to work: printing the loss added {extra} per step"
    if any(quiet):
        return f"syncs: MISSED, {median(len(s) for s in quiet):g} host syncs per steady step (target 0)"
    return f"syncs: OK, 0 host syncs per steady step over {len(quiet)} steps; printing the loss adds 1"


def check_flight(out: Path) -> str:
    """NCCL's Flight Recorder after 3 all-reduces over a 1-rank group, read by ``lit_ddp._torch`` as the watchdog
    reads it, kept as OUT/flight_recorder_rank0.pkl.gz (torch's pickle, its ``entries``) for tests/data."""
    import torch.distributed as dist

    from lit_ddp import _torch

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):  # on by default from torch 2.13 only
        os.environ.setdefault(name, "2000")
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        tensor = torch.ones(1024, device=device)
        for _ in range(3):
            dist.all_reduce(tensor)
        torch.cuda.synchronize()
        entries = _torch.flight_recorder_entries()
    finally:
        dist.destroy_process_group()
    (out / "flight_recorder_rank0.pkl.gz").write_bytes(gzip.compress(pickle.dumps({"entries": entries})))
    names = [e.get("profiling_name", "?") for e in entries]
    print(f"{len(entries)} entries: {names}; states {[e.get('state') for e in entries]}")
    found = sum("all_reduce" in n for n in names)
    return f"flight: {'OK' if found >= 3 else 'MISSED'}, {found} of 3 all-reduces in the Flight Recorder"


# Each check's time limit (s) in ``run`` and its function, in the order run runs them (events reads profile's run).
CHECKS: dict[str, tuple[int, Callable[[Path], str]]] = {
    "profile": (45, check_profile), "events": (25, check_events), "syncs": (35, check_syncs),
    "flight": (20, check_flight),
}  # fmt: skip


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fetch", help="the wheels the GPU image lacks, into .whl/ (here)")
    run_parser = commands.add_parser("run", help="the whole session (on the GPU machine)")
    run_parser.add_argument("out", type=Path, help="logs, summary.txt and the files for tests/data go here")
    names = [s.name for s in steps(Path())]
    run_parser.add_argument("--only", type=lambda v: set(v.split(",")), help=f"some of {','.join(names)}")
    check_parser = commands.add_parser("check", help="one check")
    check_parser.add_argument("name", choices=list(CHECKS))
    check_parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if getattr(args, "only", None) and not args.only <= set(names):
        parser.error(f"--only: unknown step(s) {','.join(sorted(args.only - set(names)))}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.command == "fetch":
        platforms = [
            f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
        ]
        return subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d",
                               str(ROOT / ".whl"), *WHEELS]).returncode  # fmt: skip
    if not torch.cuda.is_available():
        print(f"gpu_check: error: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "nothing was run", file=sys.stderr)  # fmt: skip
        return 2
    if args.command == "run":
        return run(args.out, args.only)
    args.out.mkdir(parents=True, exist_ok=True)
    verdict = CHECKS[args.name][1](args.out)
    print(verdict, flush=True)
    return 1 if "MISSED" in verdict else 0


if __name__ == "__main__":
    sys.exit(main())
