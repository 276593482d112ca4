"""The tool's exceptions, how a run can end, and the exit codes of ``python -m lit_ddp.fit``: the ground floor,
importing nothing of the tool, so every other module may use it.

    python -m lit_ddp.fit --devices 0      # UsageError: one line on stderr, exit 2, no rank started

Exit codes: 0 done; 1 a rank failed (``SyncError``, ``NonFiniteLossError``, any other error); 2 bad input,
reported in one line before any rank starts; 143 (128 + SIGTERM) stopped by SIGTERM.
"""

import argparse
import enum
import os
import sys
from typing import NoReturn

PROG = "lit-ddp-fit"

EXIT_FAILED = 1
EXIT_USAGE = 2
# report, trace_report, forecast: the text printed, the picture asked for not written (its folder not writable;
# without matplotlib they say how to get it and exit 0); --no-plot asks for none.
EXIT_NO_PICTURE = 1


def prog() -> str:
    """How a message of a training process begins: ``lit-ddp-fit`` where the CLI runs (``python -m lit_ddp.fit``,
    the console script, and the ranks they start), ``lit_ddp`` in a user's own script."""
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    cli = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fit.py")
    return PROG if argv0 == cli or os.path.basename(argv0) == PROG else "lit_ddp"


class Ending(enum.IntEnum):
    """How training ended when it did not raise; the value is the exit code."""

    FINISHED = 0
    # 128 + SIGTERM, what a shell reports for a terminated process: a preempted job must not look finished.
    SIGTERM = 143


class UsageParser(argparse.ArgumentParser):
    """``argparse`` whose bad input is one line, ``PROG: error: ...``, and exit 2, as ``fit``'s: the usage block is
    for ``--help``. The read-only commands (report, forecast, trace_report, allreduce_probe) parse with it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """Bad command line, config or checkpoint: one line on stderr and exit 2, before any rank is started."""


class UnusedParametersError(UsageError, RuntimeError):
    """Parameters that got no gradient while DDP expects every one (``find_unused_parameters=False``): raised on
    every rank after the first backward, exit 2 like any other input the run cannot use. A ``RuntimeError`` too,
    as DDP's own error for them is: a caller's ``except RuntimeError`` still catches it."""


class ClusterSettingsError(UsageError, ValueError):
    """The cluster's settings disagree with the Trainer's (Slurm's ``--ntasks-per-node`` is not ``devices``): found
    at launch, before any rank trains. A ``ValueError`` too, as Lightning's own check raises."""


class SyncError(RuntimeError):
    """Ranks hold different parameters or gradients; raised on every rank at once."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf on at least one rank; raised on every rank at the same step."""


class UnevenDataError(RuntimeError):
    """Ranks whose training data ends at different batches of an epoch (``StepSync(uneven="error")``); raised on
    every rank at the same step, before any rank has run out."""


class StartTimeoutError(RuntimeError):
    """Ranks that never joined the rendezvous by the start's timeout, named with their node and the settings each
    joined rank was started with; raised on every rank that joined. ``speaks``: this rank says it though it is not
    rank 0 (rank 0 never came: the first rank of each node that waited for it)."""

    def __init__(self, line: str, speaks: bool = False) -> None:
        super().__init__(line)
        self.speaks = speaks


class RecordError(ValueError):
    """A run record (``phases.json``, ``comm.json``) that cannot be read: one line naming the file and why."""


class ForecastError(ValueError):
    """An input the forecast cannot use (missing file or field, impossible topology); one line for the user."""


# Raised on every rank at the same step, so one report (rank 0's, or a StartTimeoutError's that ``speaks``) is enough;
# each with its exit code.
AGREED_ERRORS = {SyncError: EXIT_FAILED, NonFiniteLossError: EXIT_FAILED, UnusedParametersError: EXIT_USAGE,
                 UnevenDataError: EXIT_FAILED, StartTimeoutError: EXIT_FAILED}  # fmt: skip
