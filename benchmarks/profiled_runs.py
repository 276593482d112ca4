"""The profiled variant run again and again, counting how each run ended (every one exit 0 wanted): a rank that
crashed (``rank N exited with signal SIGSEGV``) is what it looks for.

    nice -n 10 python benchmarks/profiled_runs.py                 # 30 runs in a row (about 20 s each, 2 cores)
    python benchmarks/profiled_runs.py --runs 5 --keep /tmp/runs  # each run's stderr kept there

The run is issue 40's: ``python -m lit_ddp.fit --devices 2 --config configs/mini_train_profile.yaml --model.dim 2048
--model.num_layers 2 --trainer.strategy.bucket_cap_mb 8 --trainer.max_steps 12`` on the CPU, with
``PYTHONFAULTHANDLER=1`` (a crashed rank's threads are in its stderr). It profiles steps 2-4 while StepSync's
gather of each step is read a step later: a gather in flight while the profiler stopped crashed a rank in about
one run of five (docs/traces.md).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import lightning  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import ROOT, child_env  # noqa: E402
from lit_ddp.formatting import table  # noqa: E402

PROFILED_RUN = ("-m", "lit_ddp.fit", "--devices", "2", "--trainer.accelerator", "cpu",
                "--config", str(ROOT / "configs" / "mini_train_profile.yaml"), "--model.dim", "2048",
                "--model.num_layers", "2", "--trainer.strategy.bucket_cap_mb", "8",
                "--trainer.max_steps", "12")  # fmt: skip
SIGNALLED = "exited with signal"  # the CLI's line for a rank that a signal ended (SIGSEGV, SIGABRT)


def one_run(cwd: Path, timeout: float) -> tuple[str, str, float]:
    """The run's exit code (or ``timeout``), its stderr and its wall seconds."""
    start = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, *PROFILED_RUN], cwd=cwd, env=child_env(PYTHONFAULTHANDLER="1"),
                                capture_output=True, text=True, timeout=timeout)  # fmt: skip
        code, stderr = str(result.returncode), result.stderr
    except subprocess.TimeoutExpired as err:
        code, stderr = "timeout", (err.stderr or b"").decode(errors="replace")
    return code, stderr, time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/profiled_runs.py", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="runs in a row (default 30)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take before it counts as hung")
    p.add_argument("--keep", type=Path, help="write each run's stderr to KEEP/run<i>.stderr")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    codes: Counter = Counter()
    signalled, walls = 0, []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            code, stderr, wall = one_run(Path(tmp), args.timeout)
        codes[code] += 1
        walls.append(wall)
        crashed = SIGNALLED in stderr
        signalled += crashed
        print(f"run {i + 1}/{args.runs}: exit {code} after {wall:.1f} s{' (a rank signalled)' if crashed else ''}",
              file=sys.stderr, flush=True)  # fmt: skip
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"run{i + 1}.stderr").write_text(stderr)
        if code != "0":
            print(f"run {i + 1}: stderr ends:\n{stderr[-3000:]}", file=sys.stderr, flush=True)
    clean = codes.get("0", 0)
    seen = ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())) or "-"
    print(f"Profiled runs, torch {torch.__version__}, lightning {lightning.__version__}:")
    print(table(("runs", "exit 0", "exit codes", "a rank signalled", "median wall (s)"),
                [(str(args.runs), str(clean), seen, str(signalled), f"{statistics.median(walls):.1f}")]))  # fmt: skip
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
