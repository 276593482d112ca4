"""The scaling forecast held against a measured run on this machine: 1 rank + probe -> forecast 2 ranks -> run 2.

    python benchmarks/forecast_check.py            # dims 1024 and 4096, 4 layers, 4 MiB buckets, gloo

For each dim, runs of the profile config with ``--model.num_layers 4 --trainer.strategy.bucket_cap_mb 4`` (four
buckets, so some communication hides under backward): a 1-rank run; two 1-rank runs side by side ("1+1");
``lit_ddp.allreduce_probe`` on 2 ranks up to the largest bucket; then the 2-rank run. It prints, per phase
(steady medians, the slowest rank), the inputs, the 2-rank forecast (``--link measured``) from the 1-rank run
and from the side-by-side pair, the 2-rank measurement, and the errors. Exit code 1 when the forecast from the
1-rank run misses the step by more than 15%.

Why two forecasts: on a GPU node every rank has its own GPU, so one rank's compute is every rank's compute.
Here two ranks share two cores, their memory bandwidth and caches, so compute per rank slows down whatever
the communication does; the side-by-side pair measures that slowdown without any communication, and the
gap that is left between its forecast and the 2-rank run is the model's: the all-reduce, and gloo's threads
taking CPU from compute while they overlap (the probe runs on idle cores).

Threads: every run and the probe get ``OMP_NUM_THREADS=1``. Without it Lightning gives a 1-rank run both
cores and each of 2 ranks one (``cpu_count // ranks``), so per-rank compute would differ by construction.
Other work on the machine skews everything: the load average is printed first.
"""

import argparse
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import ROOT, child_env  # noqa: E402
from lit_ddp.errors import ForecastError  # noqa: E402
from lit_ddp.formatting import fmt_bandwidth  # noqa: E402
from lit_ddp.scaling.links import topology  # noqa: E402
from lit_ddp.scaling.model import Bucket, Measured, measured_run, simulate  # noqa: E402

CONFIG = ROOT / "configs" / "mini_train_profile.yaml"
TARGET = 0.15  # the target: the step within 15%


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen, Path]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=child_env(OMP_NUM_THREADS="1"),
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    return proc, log


def _wait(proc: subprocess.Popen, log: Path, timeout: float) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"`{' '.join(proc.args)}` ran over {timeout} s; see {log}") from None
    if code:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"`{' '.join(proc.args)}` exited {code}; last lines of {log}:\n{tail}")


def _fit_args(devices: int, dim: int, steps: int, out: Path) -> list[str]:
    return ["lit_ddp.fit", "--config", str(CONFIG), "--devices", str(devices), "--trainer.max_steps", str(steps),
            "--model.dim", str(dim), "--model.num_layers", "4", "--trainer.strategy.bucket_cap_mb", "4",
            "--trainer.logger.init_args.save_dir", str(out)]  # fmt: skip


def fit(devices: int, dim: int, steps: int, out: Path) -> Measured:
    """One profiled run, read back."""
    proc, log = _start(_fit_args(devices, dim, steps, out), out.with_suffix(".log"))
    _wait(proc, log, timeout=600)
    return measured_run(out / "mini_train_profile" / "version_0")


def fit_side_by_side(dim: int, steps: int, out: Path) -> Measured:
    """Two 1-rank runs at once: per-rank compute while two ranks share this machine's cores, memory bandwidth
    and caches, without any communication. Per phase the slower of the two, as a 2-rank job would wait for."""
    started = [_start(_fit_args(1, dim, steps, out / f"copy{i}"), out / f"copy{i}.log") for i in range(2)]
    for proc, log in started:
        _wait(proc, log, timeout=600)
    a, b = (measured_run(out / f"copy{i}" / "mini_train_profile" / "version_0") for i in range(2))
    slower = {f.name: max(getattr(a, f.name), getattr(b, f.name)) for f in fields(Measured)
              if f.name not in ("buckets", "compression", "rows_per_rank")}  # fmt: skip
    buckets = tuple(Bucket(x.nbytes, max(x.ready_ms, y.ready_ms)) for x, y in zip(a.buckets, b.buckets, strict=True))
    return replace(a, buckets=buckets, **slower)


def check(dim: int, steps: int, tmp: Path) -> tuple[float, float]:
    """Prints the table for one dim; returns the step's relative error, forecast from 1 rank and from 2 ranks
    side by side."""
    one = fit(1, dim, steps, tmp / f"d{dim}_1rank")
    # Long enough that the two copies, started together, overlap for most of their steps.
    side_steps = max(steps, math.ceil(8000 / one.step_ms))
    side = fit_side_by_side(dim, side_steps, tmp / f"d{dim}_side")
    largest = int(max(b.nbytes for b in one.buckets))
    probe = tmp / f"d{dim}_probe.json"
    proc, log = _start(["lit_ddp.allreduce_probe", "--nproc", "2", "--max-bytes", str(largest), "--out", str(probe)],
                       tmp / f"d{dim}_probe.log")  # fmt: skip
    _wait(proc, log, timeout=300)
    topo = topology(("measured", None), gpus_per_node=2, probe=probe)
    from_one, from_side = simulate(one, 2, topo), simulate(side, 2, topo)
    two = fit(2, dim, steps, tmp / f"d{dim}_2rank")

    def row(name: str, *values: float) -> str:
        m2 = values[-1]
        errors = [f"{(v - m2) / m2:+.0%}" if m2 > 0.05 else "-" for v in values[2:4]]
        return f"{name:<24}" + "".join(f"{v:>10.2f}" for v in values) + "".join(f"{e:>10}" for e in errors)

    print(f"\ndim {dim}, 4 layers, {len(one.buckets)} buckets ({sum(b.nbytes for b in one.buckets):,.0f} bytes), "
          f"gloo; medians of {one.n_steps} / {side.n_steps} / {two.n_steps} steady steps; probe fit: busbw "
          f"{fmt_bandwidth(topo.intra.busbw_gbps)}, {topo.intra.hop_latency_us:.0f} us per step")  # fmt: skip
    print(f"{'ms':<24}{'1 rank':>10}{'1+1 rank':>10}{'fcst(1)':>10}{'fcst(1+1)':>10}{'2 ranks':>10}"
          f"{'err(1)':>10}{'err(1+1)':>10}")  # fmt: skip
    fc = (from_one, from_side)
    print(row("forward", one.forward_ms, side.forward_ms, one.forward_ms, side.forward_ms, two.forward_ms))
    print(row("backward", one.backward_ms, side.backward_ms, *(f.backward_ms for f in fc), two.backward_ms))
    last = [max(b.ready_ms for b in m.buckets) for m in (one, side, two)]
    print(row("  compute (last bucket)", last[0], last[1], last[0], last[1], last[2]))
    print(row("  exposed comm", one.exposed_ms, side.exposed_ms, *(f.exposed_ms for f in fc), two.exposed_ms))
    print(row("  after comm", one.tail_ms, side.tail_ms, one.tail_ms, side.tail_ms, two.tail_ms))
    print(row("all-reduce, sum", one.comm_ms, side.comm_ms, *(f.comm_ms for f in fc), two.comm_ms))
    print(row("update", one.update_ms, side.update_ms, one.update_ms, side.update_ms, two.update_ms))
    print(row("other", one.other_ms, side.other_ms, one.other_ms, side.other_ms, two.other_ms))
    print(row("step", one.step_ms, side.step_ms, *(f.step_ms for f in fc), two.step_ms))
    errors = tuple((f.step_ms - two.step_ms) / two.step_ms for f in fc)
    for label, error in zip(("1 rank", "2 side-by-side 1-rank runs"), errors, strict=True):
        verdict = "within" if abs(error) <= TARGET else "MISSED"
        print(f"step forecast from {label}: error {error:+.1%} ({verdict} the {TARGET:.0%} target)")
    print(f"load average after dim {dim}: {os.getloadavg()[0]:.2f}")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=12, help="steps per run; step 0 is warm-up")
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (other work skews all of it)")
    with tempfile.TemporaryDirectory(prefix="forecast_check_") as tmp:
        try:
            errors = {dim: check(dim, args.steps, Path(tmp)) for dim in args.dims}
        except ForecastError as e:
            raise SystemExit(f"forecast_check: {e}") from None
    print("\nstep error per dim, forecast from 1 rank / from 1+1 ranks: "
          + ", ".join(f"{d}: {a:+.1%} / {b:+.1%}" for d, (a, b) in errors.items()))  # fmt: skip
    return 0 if all(abs(e[0]) <= TARGET for e in errors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
