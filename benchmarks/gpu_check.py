"""The GPU check: what only a CUDA machine can tell about the port, in one report (meant to take under 4 minutes on
one H200; sized, not yet timed there).

    python benchmarks/gpu_check.py gpu_check.txt            # or: python -m benchmarks.gpu_check gpu_check.txt
    python benchmarks/gpu_check.py out.txt --sections syncs,busy --quick

Prints one report and writes the same text to OUT, section by section (a run cut short keeps what it measured).
Without a CUDA device it exits 2 with one line, before anything else; it exits 1 when a section crashed (the
traceback is in the report) and 0 otherwise: a missed target is a finding, listed in the verdicts at the end.

Sections (``--sections``, comma-separated, all by default; the header always comes first), one module each:

paths    ``gpu_paths.py``: issue 40's CUDA paths driven directly, in seconds: StepSync's row without a host sync,
         bucket arrivals on the GPU's timeline, the allocator's peak left to the user after the measured steps.
syncs    ``gpu_syncs.py``: host syncs per steady step and their call sites, from
         ``torch.cuda.set_sync_debug_mode("warn")`` over steps 11..20 of an in-process 1-GPU fit: with the tool's
         per-step work off (target 0), and with LossMonitor printing every step (1 expected: StepSync's host
         read), which shows that the counter works.
busy     ``gpu_busy.py``: PhaseTimer's GPU-busy time against torch.profiler's own figures for the same steps
         (within 5%?).
events   ``gpu_events.py``: PhaseTimer's CUDA-event phase times against a plain loop timed with ``synchronize()``.
scaling  ``gpu_scaling.py``: ms per step on one GPU: the notes' plain loop against the port's default config and
         ``configs/fast.yaml``, dims 1024/4096/8192, batch 32/1024, and where the port's overhead drops under 5%.

Each section's function says what it measures and why that way; what they share (the budget, in-process fits)
is ``gpu_fits.py``. The GPU tests and the suite are ``benchmarks/gpu_session.sh``'s to run, not this check's.
"""

import argparse
import contextlib
import importlib
import platform
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

if TYPE_CHECKING:
    from benchmarks.gpu_fits import Budget, Section

# Each section's module and function, imported when it runs: without CUDA the refusal comes after torch's import
# alone (Lightning's takes some 5 s on a small machine).
RUNNERS = {
    "paths": ("gpu_paths", "paths_section"),
    "syncs": ("gpu_syncs", "syncs_section"),
    "busy": ("gpu_busy", "busy_section"),
    "events": ("gpu_events", "events_section"),
    "scaling": ("gpu_scaling", "scaling_section"),
}
SECTIONS = tuple(RUNNERS)


def runner(name: str) -> "Callable[[Budget], Section]":
    module, function = RUNNERS[name]
    return getattr(importlib.import_module(f"benchmarks.{module}"), function)


class Report:
    """Prints each section as it is done and appends it to the output file, numbering the sections."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.added = 0
        path.write_text("")

    def add(self, section: "Section", elapsed_s: Optional[float] = None, numbered: bool = True) -> None:
        took = f" ({elapsed_s:.0f} s)" if elapsed_s is not None else ""
        if numbered:
            self.added += 1
        number = f"{self.added}. " if numbered else ""
        text = "\n".join([f"== {number}{section.title}{took} ==", *section.lines, "", ""])
        print(text, end="", flush=True)
        with self.path.open("a") as f:
            f.write(text)


def header() -> "Section":
    """torch, lightning, CUDA, cuDNN, NCCL, driver, GPU."""
    import lightning

    from benchmarks.gpu_fits import Section
    from lit_ddp import _torch

    props = torch.cuda.get_device_properties(0)
    nccl = "-"
    with contextlib.suppress(Exception):
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    api = _torch.cuda_driver_version() or 0  # the driver's CUDA version, e.g. 13000
    supports = f" (supports CUDA {api // 1000}.{api % 1000 // 10})" if api else ""
    return Section(
        f"gpu_check, {datetime.now():%Y-%m-%d %H:%M}, {socket.gethostname()}",
        [
            f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
            f"NCCL {nccl}), lightning {lightning.__version__}, Python {platform.python_version()}",
            f"{torch.cuda.device_count()} GPU(s) visible; device 0: {props.name}, sm_{props.major}{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs",
            f"driver {driver_version()}{supports}; fp32 matmul precision "
            f"{torch.get_float32_matmul_precision()!r} ('highest': no TF32)",
        ],
    )


def driver_version() -> str:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({type(err).__name__})"
    return (result.stdout.strip().splitlines() or ["unknown"])[0]


def section_list(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names or any(n not in SECTIONS for n in names):
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {','.join(SECTIONS)}")
    return names


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the report is also written here")
    parser.add_argument("--sections", type=section_list, default=SECTIONS,
                        help=f"some of {','.join(SECTIONS)} (default: all)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer steps (about half)")
    return parser.parse_args(argv)


def run_section(name: str, budget: "Budget") -> "Section":
    """One section; a crash becomes a section with the traceback, so that it does not hide the others."""
    from benchmarks.gpu_fits import Section

    try:
        return runner(name)(budget)
    except Exception as err:
        lines = traceback.format_exc().rstrip().splitlines()
        first_line = (str(err).splitlines() or [""])[0]
        return Section(f"{name}: CRASHED", lines, [f"{name}: CRASHED, {type(err).__name__}: {first_line}"], True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: error: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
              "nothing was run", file=sys.stderr)  # fmt: skip
        return 2
    from benchmarks.gpu_fits import QUICK, Budget, Section

    budget = QUICK if args.quick else Budget()
    report = Report(args.out)
    report.add(header(), numbered=False)
    verdicts, crashed, start = [], False, time.perf_counter()
    for name in (n for n in SECTIONS if n in args.sections):
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        section_start = time.perf_counter()
        section = run_section(name, budget)
        crashed |= section.crashed
        verdicts += section.verdicts
        report.add(section, time.perf_counter() - section_start)
    verdict_lines = [f"- {v}" for v in verdicts]
    report.add(Section(f"Verdicts (total {time.perf_counter() - start:.0f} s)", verdict_lines), numbered=False)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
