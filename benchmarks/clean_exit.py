"""The short job run again and again, counting the runs that do not end cleanly (0 wanted): a rank that aborts at
teardown ("terminate called without an active exception", SIGABRT) is what it looks for.

    python benchmarks/clean_exit.py                         # each case 20 times in a row
    python benchmarks/clean_exit.py --runs 5 --cases fit,manual
    /path/to/other/venv/bin/python benchmarks/clean_exit.py  # on another torch: this interpreter runs the jobs

The cases. ``fit``: ``python -m lit_ddp.fit --devices 2 --trainer.accelerator cpu`` (forked ranks). ``manual``: a
user's script with Lightning's own ``strategy="ddp"`` (rank 0 is the script, rank 1 the script started again, each
ending in the interpreter's own exit) and manual optimization, with PhaseTimer, CommMonitor, SyncCheck and
LossMonitor. ``reference``: the notes' plain loop, ``torchrun --nproc_per_node 2 -m lit_ddp.reference``. A run is
unclean when its command exits non-zero or any rank's stderr says ``terminate called`` (a rank 1 of ``ddp`` that
aborts after rank 0 exited leaves the command's exit code 0).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import lightning  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import child_env  # noqa: E402
from lit_ddp.formatting import table  # noqa: E402

MANUAL_SCRIPT = """
from lightning.pytorch import Trainer, seed_everything

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, SyncCheck


class Manual(LinearRegression):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


if __name__ == "__main__":
    seed_everything(0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[PhaseTimer(), CommMonitor(), SyncCheck(), LossMonitor()])
    trainer.fit(Manual(dim=32), FixedBatchDataModule(dim=32, batch_size=8))
"""

CASES = {
    "fit": ["-m", "lit_ddp.fit", "--devices", "2", "--trainer.accelerator", "cpu"],
    "manual": ["manual_script.py"],
    "reference": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "lit_ddp.reference"],
}  # fmt: skip
ABORT = "terminate called"


def run_case(case: str, runs: int, timeout: float) -> tuple[str, ...]:
    """``runs`` runs of ``case`` in a row, each in a fresh directory: its row of the table."""
    codes: Counter = Counter()
    aborts, walls = 0, []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "manual_script.py").write_text(MANUAL_SCRIPT)
            start = time.perf_counter()
            try:
                result = subprocess.run([sys.executable, *CASES[case]], cwd=tmp, env=child_env(), capture_output=True,
                                        text=True, timeout=timeout)  # fmt: skip
                code, stderr = result.returncode, result.stderr
            except subprocess.TimeoutExpired:
                code, stderr = "timeout", ""
            walls.append(time.perf_counter() - start)
        aborted = ABORT in stderr
        aborts += aborted
        if code != 0:
            codes[code] += 1
        if code != 0 or aborted:
            print(f"{case}: exit {code}; stderr ends:\n{stderr[-1500:]}", file=sys.stderr)
    unclean = sum(codes.values())
    seen = ", ".join(f"{c}: {n}" for c, n in sorted(codes.items(), key=lambda item: str(item[0]))) or "-"
    return case, str(runs), str(unclean), seen, str(aborts), f"{statistics.median(walls):.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/clean_exit.py", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs of each case, in a row")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take before it counts as hung")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    if unknown := [c for c in cases if c not in CASES]:
        p.error(f"--cases: unknown {unknown}, choose from {list(CASES)}")
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    rows = [run_case(case, args.runs, args.timeout) for case in cases]
    print(f"Clean exits, torch {torch.__version__}, lightning {lightning.__version__}, {args.runs} runs per case:")
    print(table(("case", "runs", "non-zero exits", "exit codes", "'terminate called'", "median wall (s)"), rows))


if __name__ == "__main__":
    main()
