"""The GPU check's scaling section: ms per step on one GPU, the notes' plain loop against the port, by size.

    python benchmarks/gpu_check.py out.txt --sections scaling

Step times come from step marks inside the runs (``benchmarks.common``'s clock and steady median, as in
``benchmarks/step_time.py``); ``scaling_section`` says how the 24 runs fit the budget.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Optional

from benchmarks.common import ROOT, child_env, clock_args, fmt_num, fmt_pct, ratio, read_rank_files, steady_step_ms
from benchmarks.gpu_fits import CLEAN_ENV, LIMIT, Budget, Section, in_process_run
from lit_ddp.formatting import table

SCALING_SHAPES = [(dim, batch) for dim in (1024, 4096, 8192) for batch in (32, 1024)]
# `python -m lit_ddp.reference` for several configurations in one interpreter (one start-up instead of one per
# configuration); each main() builds and destroys its own 1-rank process group and writes its own timings.
REFERENCE_DRIVER = """
import json, sys
from lit_ddp import reference
for argv in json.loads(sys.argv[1]):
    reference.main(argv)
"""


class ScalingRow(NamedTuple):
    dim: int
    batch: int
    plain: float  # ms per step: the notes' loop, torch's default Adam
    plain_fused: float  # the same with --fused
    port: float  # the port's default config
    port_fast: float  # configs/fast.yaml

    @property
    def overhead(self) -> float:
        return ratio(self.port, self.plain) - 1

    @property
    def fast_overhead(self) -> float:
        return ratio(self.port_fast, self.plain_fused) - 1


def scaling_rows(rows: Sequence[ScalingRow]) -> list[tuple]:
    return [
        (r.dim, r.batch, fmt_num(r.plain), fmt_num(r.plain_fused), fmt_num(r.port), fmt_num(r.port_fast),
         fmt_pct(r.overhead), fmt_pct(r.fast_overhead))
        for r in rows
    ]  # fmt: skip


def under_limit_from(
    rows: Sequence[ScalingRow], overhead: Callable[[ScalingRow], float], limit: float = LIMIT
) -> Optional[ScalingRow]:
    """The first of ``rows`` (ordered from small to large work) from which on every row's overhead is under
    ``limit``; None when the last row's is not."""
    found = None
    for row in reversed(rows):
        if not overhead(row) < limit:
            break
        found = row
    return found


def under_limit_line(rows: Sequence[ScalingRow], overhead: Callable[[ScalingRow], float], what: str) -> str:
    first = under_limit_from(rows, overhead)
    if first is None:
        return f"{what}: the port's per-step overhead falls under {LIMIT:.0%} nowhere in this table"
    where = f"from dim {first.dim} / batch {first.batch} on"
    everywhere = " (everywhere in this table)" if first is rows[0] else ""
    return f"{what}: the port's per-step overhead falls under {LIMIT:.0%} {where}{everywhere}"


def reference_step_ms(configs: list[tuple[int, int, bool]], steps: int, warmup: int, timeout_s: int) -> dict:
    """Steady ms per step of ``python -m lit_ddp.reference --dim D --batch-size B [--fused]`` for each config, all
    in one child process (``REFERENCE_DRIVER``) with the environment the check started with, from the step marks
    each writes with ``--timings``."""
    with tempfile.TemporaryDirectory() as tmp:
        dirs, argvs = {}, []
        for dim, batch, fused in configs:
            dirs[(dim, batch, fused)] = out = Path(tmp, f"d{dim}_b{batch}_{'fused' if fused else 'default'}")
            out.mkdir()
            argv = ["--dim", str(dim), "--batch-size", str(batch), "--steps", str(steps), "--timings", str(out)]
            argvs.append(argv + (["--fused"] if fused else []))
        cmd = [sys.executable, "-c", REFERENCE_DRIVER, json.dumps(argvs)]
        env = child_env(CLEAN_ENV)
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"the plain loop failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        return {config: step_ms(out, warmup) for config, out in dirs.items()}


def step_ms(out_dir: Path, warmup: int) -> float:
    return steady_step_ms([r["step_starts"] for r in read_rank_files(out_dir)], warmup)


@contextlib.contextmanager
def working_dir(path: Path) -> Iterator[None]:
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def port_step_ms(dim: int, batch: int, fast: bool, steps: int, warmup: int) -> float:
    """Steady ms per step of ``python -m lit_ddp.fit --devices 1 [--config configs/fast.yaml]``, run in this
    process through ``cli_main`` (the command's own code, without its ~13 s start-up), timed by StepClock as in
    ``benchmarks/step_time.py``; its output (the Step lines) goes to a buffer."""
    from lit_ddp.fit import cli_main  # only this section runs the CLI

    config = ["--config", str(ROOT / "configs" / "fast.yaml")] if fast else []
    with tempfile.TemporaryDirectory() as tmp, working_dir(Path(tmp)), in_process_run(quiet=False):
        args = [*config, "--devices", "1", "--model.dim", str(dim), "--data.batch_size", str(batch),
                "--trainer.max_steps", str(steps), *clock_args(Path(tmp))]  # fmt: skip
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):  # console.setup points the loggers at this stdout
                cli_main(args)
        except Exception as err:
            tail = out.getvalue()[-2000:]
            raise RuntimeError(f"python -m lit_ddp.fit {' '.join(args)} failed: {err!r}\n{tail}") from err
        return step_ms(Path(tmp), warmup)


def scaling_section(budget: Budget) -> Section:
    """Per-step time on one GPU, the notes' plain loop against the port, from step timestamps inside the runs.

    The plain loop is ``lit_ddp.reference`` (prints the loss every step, as the notes do: it has no flag to stop
    printing) with torch's default Adam and with ``--fused``; the port runs its default config (``python -m
    lit_ddp.fit --devices 1``) and ``configs/fast.yaml`` (fused Adam, no printing). Both mark the wall clock at the
    top of every step and once at the end (the reference with ``--timings``, after its per-step ``.item()``; the
    port with ``benchmarks.common.StepClock``, after a ``synchronize()``, so fast.yaml, which reads nothing back,
    waits for the GPU once per step as the plain loop does); a step is the difference of consecutive marks, the
    first steps are dropped, the figure is the median, so start-up is never in it. So that 24 runs fit the
    budget, none pays a start-up of its own: the port runs in this process through ``cli_main`` (the command's
    code), the plain loop in one child process that calls ``lit_ddp.reference.main`` for each configuration in
    turn. Overhead = port default / plain default - 1 and port fast / plain --fused - 1. Rows are ordered by the
    plain loop's step time, so "from ... on" reads down.
    """
    steps, warmup = budget.scaling_steps, budget.scaling_warmup
    section = Section(f"ms per step on one GPU, the port against the plain loop ({steps} steps, {warmup} dropped)")
    configs = [(dim, batch, fused) for dim, batch in SCALING_SHAPES for fused in (False, True)]
    plain = reference_step_ms(configs, steps, warmup, budget.reference_timeout_s)
    rows = []
    for dim, batch in SCALING_SHAPES:
        port = port_step_ms(dim, batch, fast=False, steps=steps, warmup=warmup)
        fast = port_step_ms(dim, batch, fast=True, steps=steps, warmup=warmup)
        rows.append(ScalingRow(dim, batch, plain[(dim, batch, False)], plain[(dim, batch, True)], port, fast))
    rows.sort(key=lambda r: r.plain)
    header = ("dim", "batch", "plain loop", "plain --fused", "port default", "port fast", "overhead", "fast overhead")
    section.lines += table(header, scaling_rows(rows)).splitlines()
    section.lines += [
        "overhead: port default vs plain loop; fast overhead: configs/fast.yaml vs plain loop --fused",
        "the plain loop prints the loss every step (lit_ddp.reference has no flag to stop it); fast.yaml does not",
    ]
    for line in (
        under_limit_line(rows, lambda r: r.overhead, "default config vs the plain loop"),
        under_limit_line(rows, lambda r: r.fast_overhead, "configs/fast.yaml vs the plain loop --fused"),
    ):
        section.lines.append(line)
        section.verdicts.append(f"scaling: {line}")
    return section
