"""What every benchmark shares: the repository's place, child-process environments, the step clock and its
steady median, and the formatters of the benchmarks' tables (the tables are
``lit_ddp.formatting.table``).

    from benchmarks.common import ROOT, StepClock, child_env, steady_step_ms

It imports no tool code (nothing of ``lit_ddp``): the bare Lightning loop (``benchmarks/bare_lightning.py``)
takes its clock from here and must run Lightning alone. A benchmark run as a file (``python
benchmarks/step_time.py``) puts the repository on ``sys.path`` itself, in one line before its first
``benchmarks`` import; this module keeps it there for what imports by class path later (the port's CLI finds
``STEP_CLOCK`` by name, in a child process through ``child_env``'s PYTHONPATH, in-process through
``sys.path``).
"""

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def child_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> dict[str, str]:
    """``base`` (by default this process's environment) and ``extra``, with the repository first on PYTHONPATH and
    what was there kept after it: on the GPU machine jsonargparse lives in wheels unpacked onto PYTHONPATH
    (``benchmarks/gpu_session.sh``), so a child whose PYTHONPATH were replaced could not run ``lit_ddp.fit``."""
    base = os.environ if base is None else base
    path = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    return {**base, **extra, "PYTHONPATH": path}


# ------------------------------------------------------------------------------------------- shaped nodes

NODES_PREFIX = "litddp-bench-"  # the benchmarks' namespaces, apart from the tests' (litddp-test-) and a user's


class ShapedNodes:
    """Nodes of ``nodes/cluster.sh`` (``shaped_nodes``): the commands that run on them."""

    def __init__(self, count: int) -> None:
        self.count = count

    def torchrun(self, k: int, ranks_per_node: int, *args: str) -> list[str]:
        """``torchrun ARGS`` on node ``k`` (``ARGS``: ``-m module ...``), gloo bound to the node's link; node 0
        hosts the rendezvous."""
        return ["ip", "netns", "exec", f"{NODES_PREFIX}node{k}", "env", "GLOO_SOCKET_IFNAME=eth0", sys.executable,
                "-m", "torch.distributed.run", "--nnodes", str(self.count), "--nproc_per_node", str(ranks_per_node),
                "--node_rank", str(k), "--master_addr", "198.18.0.1", "--master_port", "29500", *args]  # fmt: skip


@contextmanager
def shaped_nodes(count: int, *rates: str) -> Iterator[ShapedNodes]:
    """``nodes/cluster.sh start COUNT RATES...`` (as root) for the block, stopped after it, whatever happens."""
    cluster = [str(ROOT / "nodes" / "cluster.sh")]
    env = {**os.environ, "LIT_DDP_NODES_PREFIX": NODES_PREFIX}
    subprocess.run(["bash", *cluster, "start", str(count), *rates], env=env, check=True)
    try:
        yield ShapedNodes(count)
    finally:
        subprocess.run(["bash", *cluster, "stop"], env=env, check=False)


# ------------------------------------------------------------------------------------------- the step clock


class StepClock(Callback):
    """Records ``time.time()`` at every ``on_train_batch_start`` and at the end of training, and each rank writes
    ``out_dir/rank<r>.json`` as ``lit_ddp.reference --timings`` does: ``step_starts`` and ``max_rss_mb``.

    On a GPU each mark waits for the GPU first, as the plain loop's ``.item()`` does every step: a run that reads
    nothing back (``configs/fast.yaml``) would otherwise queue steps ahead of the GPU and mark only the host's
    launch rate.

    Args:
        out_dir: Where each rank writes ``rank<r>.json``.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.starts: list[float] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._mark(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark(trainer)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        path = Path(self.out_dir, f"rank{trainer.global_rank}.json")
        path.write_text(json.dumps({"step_starts": self.starts, "max_rss_mb": rss_mb}))

    def _mark(self, trainer: Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.starts.append(time.time())


STEP_CLOCK = f"{StepClock.__module__}.{StepClock.__qualname__}"  # for --trainer.callbacks+=


def clock_args(out_dir: Path) -> list[str]:
    """``python -m lit_ddp.fit`` arguments that log under ``out_dir/runs`` and add ``StepClock`` writing to
    ``out_dir`` (last, so that ``--trainer.callbacks.out_dir`` reaches it and no callback added before)."""
    return ["--trainer.logger.init_args.save_dir", str(out_dir / "runs"), f"--trainer.callbacks+={STEP_CLOCK}",
            f"--trainer.callbacks.out_dir={out_dir}"]  # fmt: skip


def read_rank_files(out_dir: Path) -> list[dict[str, Any]]:
    """Every ``rank<r>.json`` in ``out_dir`` (the reference's ``--timings`` and StepClock's), in rank order."""
    files = sorted(out_dir.glob("rank*.json"), key=lambda p: int(p.stem[len("rank") :]))
    if not files:
        raise RuntimeError(f"no rank*.json in {out_dir}: the run wrote no step timings")
    return [json.loads(p.read_text()) for p in files]


def steady_step_ms(starts: Sequence[Sequence[float]], warmup: int) -> float:
    """Median step time (ms) over ranks and steps from each rank's step start marks (the last mark ends the last
    step), each rank's first ``warmup`` steps dropped; NaN when no step is left. On a GPU every mark comes after
    the GPU finished the step before (the plain loop reads the loss, ``StepClock`` synchronizes)."""
    return median((b - a) * 1e3 for rank in starts for a, b in zip(rank[warmup:], rank[warmup + 1 :], strict=False))


def step_samples_ms(starts: Sequence[Sequence[float]], warmup: int) -> list[float]:
    """Each step's time (ms), in time order, the mean over ranks, the first ``warmup`` steps dropped: a run's
    samples for the noise model (``lit_ddp.derive.noise``)."""
    per_rank = [[(b - a) * 1e3 for a, b in zip(rank[warmup:], rank[warmup + 1 :], strict=False)] for rank in starts]
    return [statistics.fmean(step) for step in zip(*per_rank, strict=False)]


# --------------------------------------------------------------------------- numbers in the benchmarks' tables


def median(values: Iterable[float]) -> float:
    """The median; NaN for no values (a figure not measured, printed as ``-``)."""
    values = list(values)
    return statistics.median(values) if values else math.nan


def ratio(a: float, b: float) -> float:
    """``a / b``; NaN where either is missing or ``b`` is 0."""
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt_num(value: float, digits: int = 3) -> str:
    """A plain number for a column whose header names the unit; ``-`` for NaN. (``analysis.tables.fmt_ms`` writes
    the unit into each cell, and switches to seconds.)"""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def fmt_pct(value: float) -> str:
    """A signed change: ``+4.2%``; ``-`` for NaN."""
    return "-" if math.isnan(value) else f"{value:+.1%}"


def fmt_share(value: float) -> str:
    """A share of a whole: ``87%``; ``-`` for NaN."""
    return "-" if math.isnan(value) else f"{value:.0%}"
