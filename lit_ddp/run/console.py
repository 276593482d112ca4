"""What ``python -m lit_ddp.fit`` shows: the notes' lines on stdout, without Lightning's start-up banners.

    python -m lit_ddp.fit --trainer.enable_model_summary true --trainer.profiler simple   # both still shown

The callbacks speak through Lightning's rank-zero logging (``rank_zero_info``), as Lightning's own callbacks
do, so they print in any script. Here that logging goes to stdout, and a filter drops the banners *by their
text*: setting Lightning's loggers to WARNING would also hide the model summary and profiler report a user
asked for. Importing the tool changes nothing in a script's process; a script that wants Lightning's start-up
lines and warnings dropped the same way calls ``lit_ddp.quiet_lightning()``.
"""

import logging
import os
import re
import sys
import warnings
from typing import Any, Optional, TextIO

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_ddp.formatting import Advice

# Lightning's start-up lines that say nothing the tool does not say better (the device map, the Done line) or
# that nobody can act on (a tip to install a cloud logger, every rank's "Seed set to 0"): dropped in the CLI and
# in a script that calls ``quiet_lightning``.
LIGHTNING_BANNERS = (
    r"GPU available:|TPU available:|HPU available:|IPU available:|💡 Tip:"
    r"|Initializing distributed:|-{10,}|distributed_backend=|LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES"
    r"|`Trainer.fit` stopped: `max_(steps|epochs)=\d+` reached|Seed set to \d+"
    # The precision the run asked for: the device map's and the Done line's to say.
    r"|Using (16bit|bfloat16) Automatic Mixed Precision \(AMP\)"
)
# Lightning's lines that say nothing about this run that the tool does not say better.
BANNERS = re.compile(
    rf"^(\[rank: \d+\] )?({LIGHTNING_BANNERS}"
    r"|Using default `ModelCheckpoint`|You are using a CUDA device .* Tensor Cores"
    # Under Slurm: the auto-requeue's set-up, its SIGTERM handler saying it does nothing (StepSync's stops the
    # run), the default Lightning takes at every checkpoint save (the auto-requeue's too), and "requeing job N...",
    # which "Requeued SLURM job: N" says again.
    r"|SLURM auto-requeueing enabled\. Setting signal handlers\.|Bypassing SIGTERM: \d+|requeing job \S+\.\.\."
    r"|`weights_only` was not set, defaulting to `False`\.)"
)

# Warnings of Lightning's that nobody can act on, hidden in a script that asks too (``quiet_lightning``).
LIGHTNING_WARNINGS = (
    # Any run not under srun on a machine where Slurm is installed (a login node; CI's one-node Slurm): the
    # forked and torchrun runs do not need srun, and docs/launching.md says when to use it.
    ".*The `srun` command is available on your system but is not used.*",
    # The ddp_fork/ddp_spawn parent loads rank 0's final weights from the temporary file rank 0 wrote for it.
    ".*`weights_only` was not set, defaulting to `False`.*",
    # Lightning 2.6 against newer torch's pytree and collectives APIs.
    ".*torch.distributed.nn.functional.all_gather is deprecated.*",
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
    # A short epoch under Lightning's default of 50: the tool's callbacks log every step they print or measure.
    ".*The number of training batches .* is smaller than the logging interval.*",
    # The model summary's size estimate under a mixed precision: about the summary, not the run.
    ".*is not supported by the model summary.*",
)

NOISY_WARNINGS = (
    *LIGHTNING_WARNINGS,
    # One fixed batch is the point of the experiment: no workers, no sampler.
    ".*does not have many workers.*",
    ".*Total length of .* across ranks is zero.*",
    ".*Checkpoint directory .* exists and is not empty.*",
    # A resume in mid-epoch (a requeued Slurm job, --ckpt_path last): every batch is the same one.
    ".*You're resuming from a checkpoint that ended before the epoch ended.*",
    # Only with an explicit `--trainer.accelerator cpu` on a GPU machine (auto takes the GPU): the user's choice,
    # and the device map says where each rank runs.
    ".*GPU available but not used.*",
    # --trainer.max_steps -1 without max_epochs: RunSummary's "No step limit" line says it with the step count.
    ".*`max_epochs` was not set. Setting it to 1000 epochs.*",
    # `cli_main` always passes the (expanded) argv as `args`.
    ".*LightningCLI's args parameter is intended to run from within Python.*",
)


class DropBanners(logging.Filter):
    """Drops the banners, and every info line of a rank other than 0: Lightning logs some (the auto-requeue's set-up,
    "Bypassing SIGTERM") from every task that Slurm or torchrun started, where each rank runs this same set-up;
    rank 0 speaks for all, as ``rank_zero_info`` does. Warnings and errors of every rank still pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.INFO and rank_zero_only.rank != 0:
            return False
        return not BANNERS.match(record.getMessage())


class DropLightningBanners(logging.Filter):
    """Drops Lightning's start-up lines (``LIGHTNING_BANNERS``), and nothing else, on the loggers that emit them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _LIGHTNING_BANNERS.match(record.getMessage())


_LIGHTNING_BANNERS = re.compile(rf"^(\[rank: \d+\] )?({LIGHTNING_BANNERS})")
_DROP_LIGHTNING_BANNERS = DropLightningBanners()
# Where Lightning's rank-zero helpers and its process-group set-up log from: a filter on a logger applies to every
# record made there, whichever handler (Lightning's own, or the root's of a script that set up logging) prints it.
LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.distributed",
    "lightning.fabric.utilities.seed",
)
QUIET_ENV = "LIT_DDP_QUIET_LIGHTNING"
KEEP_SUMMARY = "keep_summary"  # QUIET_ENV's value for quiet_lightning(model_summary=True)
MODEL_SUMMARY_LOGGER = "lightning.pytorch.callbacks.model_summary"  # ModelSummary's table, on rank 0
_DROP_ALL = logging.Filter("\0")  # passes no record: no logger has this name


def quiet_lightning(model_summary: bool = False) -> None:
    """In a script that uses the tool's callbacks, before its ``Trainer`` is made: Lightning's start-up lines (the
    AMP line among them) and unactionable warnings dropped as the CLI drops them, and the model summary that
    ``Trainer`` prints by default unless ``model_summary``; a profiler report and every other line still shown.
    Idempotent; nothing when ``LIT_DDP_QUIET_LIGHTNING=0``.

    It sets ``LIT_DDP_QUIET_LIGHTNING=1`` for the ranks this process starts: a ``ddp_spawn`` rank is a fresh
    interpreter, and quiets itself when it imports ``lit_ddp.callbacks`` to unpickle them (``quiet_if_asked``);
    ``ddp`` ranks run the script again, forked ones inherit the filters.
    """
    if os.environ.get(QUIET_ENV) == "0":
        return
    os.environ[QUIET_ENV] = KEEP_SUMMARY if model_summary else "1"
    _drop_lightning_noise()


def quiet_if_asked() -> None:
    """``quiet_lightning`` where the environment asks for it (``LIT_DDP_QUIET_LIGHTNING=1``: a rank started by a
    script that called it); else nothing, so that importing the tool changes nothing in a process."""
    if os.environ.get(QUIET_ENV) in ("1", KEEP_SUMMARY):
        _drop_lightning_noise()


def _drop_lightning_noise() -> None:
    summary = logging.getLogger(MODEL_SUMMARY_LOGGER)
    if os.environ.get(QUIET_ENV) == KEEP_SUMMARY:
        summary.removeFilter(_DROP_ALL)
    else:
        summary.addFilter(_DROP_ALL)
    _quiet_rich_summary()
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).addFilter(_DROP_LIGHTNING_BANNERS)  # a filter already there is not added twice
    for pattern in LIGHTNING_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)  # an equal filter is moved to the front, not repeated


def _quiet_rich_summary() -> None:
    """With rich installed, a Trainer's default summary is ``RichModelSummary``, drawn on rich's console, which no
    logging filter reaches: its ``summarize`` draws nothing while ``LIT_DDP_QUIET_LIGHTNING`` is ``1`` (wrapped once;
    the summary comes back with ``quiet_lightning(model_summary=True)`` or the variable unset)."""
    from lightning.pytorch.callbacks import RichModelSummary

    draw = RichModelSummary.summarize
    if getattr(draw, "quiet_lit_ddp", False):
        return

    def summarize(*args: Any, **kwargs: Any) -> None:
        if os.environ.get(QUIET_ENV) != "1":
            draw(*args, **kwargs)

    summarize.quiet_lit_ddp = True  # type: ignore[attr-defined]
    RichModelSummary.summarize = staticmethod(summarize)  # type: ignore[method-assign]


RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where ``rank_zero_info`` logs
_HANDLER: Optional[logging.StreamHandler] = None  # ``setup``'s, in this process


def stream() -> Optional[TextIO]:
    """The stream of ``setup``'s handler where a line of ``rank_zero_info`` would go there alone, as it is (no
    other handler on the way, the level let through, no filter but the tool's own, which pass rank 0's lines that
    are no banner): ``python -m lit_ddp.fit``'s stdout. None otherwise: in a script, or once the loggers were
    changed (another handler, or a filter of the user's on the logger or the handler)."""
    if _HANDLER is None:
        return None
    logger: Optional[logging.Logger] = logging.getLogger(RANK_ZERO_LOGGER)
    if not logger.isEnabledFor(logging.INFO) or _HANDLER.level > logging.INFO:
        return None
    if not all(isinstance(f, (DropBanners, DropLightningBanners)) for f in (*logger.filters, *_HANDLER.filters)):
        return None
    handlers = []
    while logger is not None:
        handlers += logger.handlers
        logger = logger.parent if logger.propagate else None
    return _HANDLER.stream if handlers == [_HANDLER] else None


# Set by ``setup`` for the ranks this process starts: a ddp_spawn rank is a fresh interpreter that set none of
# this up, and sets it up again (when it unpickles the CLI's own ``RunSummary``, whatever the strategy).
CONSOLE_ENV = "LIT_DDP_CONSOLE"


def setup_in_spawned_rank() -> None:
    """``setup`` again in a rank that ``ddp_spawn`` started from a process that had set it up (the variable holds
    that process's pid; while a spawned rank unpickles, ``multiprocessing.parent_process()`` is not set yet)."""
    if os.environ.get(CONSOLE_ENV, str(os.getpid())) != str(os.getpid()):
        setup()


def setup() -> None:
    """Lightning's and lit_ddp's log lines to stdout, bare, banners dropped; known-noise warnings off."""
    global _HANDLER
    os.environ[CONSOLE_ENV] = str(os.getpid())
    handler = _HANDLER = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(DropBanners())
    for name in ("lightning.pytorch", "lightning.fabric", "lit_ddp"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
    # torch's spawn logs "Terminating process N via signal SIGTERM" for each rank it stops after another failed;
    # the failed rank's own line says what happened.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    for pattern in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def advice(trainer: Trainer) -> Advice:
    """How a suggestion reads where this run prints it: under ``python -m lit_ddp.fit`` (``setup`` ran in this
    process or the one that started it), as options; in a script, as the strategy class to construct."""
    return Advice(cli=CONSOLE_ENV in os.environ, strategy=type(trainer.strategy).__name__)


def silence() -> None:
    """Nothing more on this process's stdout and stderr: a line that ends the job is said, and what would follow is
    the ranks leaving (a collective failing as its peers exit, "Connection closed by peer")."""
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
