"""What the callbacks share: speaking on rank 0 the way Lightning's own callbacks do, metrics to every logger,
every rank's part of the record to rank 0 (with the run's ``lit_ddp.records.schema.RunMeta``), and the callbacks
the tool adds to a Trainer: ``ExitsCleanly`` here, ``EndOfFit`` (``lit_ddp.callbacks.end_of_fit``), and StepSync's
``CollectiveRecorder``."""

import sys
from collections.abc import Callable
from typing import Optional, Protocol, TypeVar, runtime_checkable

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from tqdm import tqdm
from typing_extensions import override

from lit_ddp.records.schema import RunMeta
from lit_ddp.run import console, lifecycle
from lit_ddp.run.lean import LeanCallback

T = TypeVar("T")


def say(trainer: Trainer, text: str) -> None:
    """Rank 0 reports ``text`` through Lightning's logging (shown in any script), or through the progress bar
    when one is drawn (tqdm's or Rich's), so that lines and bar stay apart."""
    if not trainer.is_global_zero:
        return
    bar = trainer.progress_bar_callback
    if isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        # Above the bar while one is drawn, plainly when none is (the bar's own print() drops text then). Into a
        # file or a pipe the bar cannot be cleared ("\r" moves nothing there): start a line of our own.
        tqdm.write(text if sys.stdout.isatty() else "\n" + text)
    elif isinstance(bar, RichProgressBar) and bar.is_enabled and bar.progress is not None:
        # Rich's console draws the text above its live bar, in one piece. The bar's print() is the builtin, which
        # Rich's stdout proxy word-wraps at the terminal's width (a table's long lines broke in two) and splits
        # wherever the bar redraws; the text is the tool's, not Rich markup ("[rank 1]" is no style).
        bar.progress.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)
    elif bar is not None and bar.is_enabled:
        bar.print(text)
    else:
        rank_zero_info(text)


def line_printer(trainer: Trainer) -> Callable[[str], None]:
    """How rank 0 prints a line every step, chosen once a fit: as ``say`` does, or, where that would only put the
    line on the console of ``python -m lit_ddp.fit`` (``lit_ddp.run.console.stream``), straight into its stream. A
    line through logging makes a record, looks up its caller's frame and runs the filters: about a tenth of a
    host-bound step's tool work (docs/performance.md). On other ranks it prints nothing."""
    if not trainer.is_global_zero:
        return _nothing
    bar = trainer.progress_bar_callback
    stream = console.stream() if bar is None or not bar.is_enabled else None
    if stream is None:
        return lambda text: say(trainer, text)

    def write(text: str) -> None:
        stream.write(text + "\n")
        stream.flush()  # each line as it comes, as logging's handler flushes it (a pipe, a Slurm log)

    return write


def _nothing(text: str) -> None:
    pass


def is_last_step(trainer: Trainer, batch_idx: int) -> bool:
    """In ``on_train_batch_end``: this batch ends training (``max_steps`` reached, or the last batch of the last
    epoch)."""
    if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    return (
        max_epochs is not None
        and max_epochs > 0
        and trainer.current_epoch >= max_epochs - 1
        and batch_idx + 1 >= trainer.num_training_batches
    )


def all_gather(tensor: Tensor, world_size: int, async_op: bool = False) -> tuple[Tensor, Optional[dist.Work]]:
    """Every rank's 1-D ``tensor`` as ``[world_size, len]`` (filled once the returned work is done, when
    ``async_op``): torch's own collective (Lightning's ``all_gather`` adds an autograd Function and a stack per
    call). StepSync's per-step gather starts its own (``lit_ddp._torch.all_gather_started``)."""
    gathered = tensor.new_empty(world_size, tensor.numel())
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single (same arguments); older has the first.
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    work = gather(gathered.view(-1), tensor.contiguous(), async_op=async_op)
    return gathered, work


def gather_to_zero(trainer: Trainer, item: T) -> Optional[list[T]]:
    """Every rank's ``item`` (any picklable object, a record of bounded size) on rank 0, in rank order; None on
    the other ranks. One collective, at the end of training: nobody but rank 0 needs the whole run."""
    if trainer.world_size == 1 or not dist.is_initialized():
        return [item]
    items: Optional[list] = [None] * trainer.world_size if trainer.is_global_zero else None
    dist.gather_object(item, items, dst=0)
    return items


class ExitsCleanly(LeanCallback):
    """When training ends normally, this process will tear its process group down at exit, as the CLI does after
    ``fit`` (``lit_ddp.run.lifecycle.teardown_at_exit``): a script's ranks exit without gloo aborting one. Added by
    the tool's callbacks (``exit_cleanly``); a process whose training failed exits as Lightning leaves it."""

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        lifecycle.exit_cleanly()


def exit_cleanly(trainer: Trainer) -> None:
    """Adds ``ExitsCleanly`` to the Trainer's callbacks once (from a tool callback's ``setup`` or
    ``on_train_start``: Lightning iterates ``trainer.callbacks`` afresh for every hook)."""
    if not any(isinstance(c, ExitsCleanly) for c in trainer.callbacks):  # docs/callbacks.md lists what is added
        trainer.callbacks.append(ExitsCleanly())


def log_metrics(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Rank 0 gives ``metrics`` to every logger of the Trainer, as Lightning's ``DeviceStatsMonitor`` does."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def device_name(device: torch.device) -> str:
    """The device as the record and the roofline's datasheets name it: ``torch.cuda.get_device_name()`` on CUDA
    (``NVIDIA H200``), else its type (``cpu``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def grad_scaler(trainer: Trainer) -> Optional[torch.amp.GradScaler]:
    """The grad scaler of Lightning's ``MixedPrecision`` plugin (``16-mixed``), else None. It skips an update whose
    gradients hold inf/NaN: ``optimizer.step()`` is then not called."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None)


def meta(trainer: Trainer, clock: str) -> RunMeta:
    """What the run is, for its record."""
    device = trainer.strategy.root_device
    return RunMeta(
        world_size=trainer.world_size,
        device=str(device),
        device_name=device_name(device),
        backend=getattr(trainer.strategy, "process_group_backend", None) or "none",
        clock=clock,
        precision=str(trainer.precision),
        torch=torch.__version__,
        lightning=lightning.__version__,
    )


@runtime_checkable
class ProfilesSteps(Protocol):
    """A callback that profiles some steps (PhaseTimer): the others leave those steps out of their summaries."""

    profiled_steps: range


def profiling_callback(trainer: Trainer) -> Optional[ProfilesSteps]:
    """The callback of ``trainer`` that profiles steps, if any (its ``profiled_steps`` are known once its
    ``on_train_start`` ran). A Protocol's ``isinstance`` is slow: find it once a fit, not every step."""
    return next((c for c in trainer.callbacks if isinstance(c, ProfilesSteps)), None)


def profiled_steps(trainer: Trainer) -> range:
    """The steps a callback of ``trainer`` profiles (none when no callback does)."""
    found = profiling_callback(trainer)
    return found.profiled_steps if found is not None else range(0)
