"""Every private Lightning name that lit_ddp relies on, in one place, each with what it relies on.

    pytest tests/test_private_apis.py      # fails loudly, naming the name, when the installed Lightning changed

Tested with lightning 2.6 (pyproject allows >=2.6,<2.7). ``lit_ddp/run/strategy.py`` overrides three private
methods of ``DDPStrategy`` (``_configure_launcher``, ``_setup_model``, ``_register_ddp_hooks``) and sets its
``_start_method`` before the launcher is made; ``lit_ddp/run/launchers.py`` subclasses the two launchers (exported
here under public names) and overrides ``_call_children_scripts``; everything else private is reached through the
functions below and nowhere else. ``PRIVATE_NAMES`` lists them all for the test.
"""

import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, Optional

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.overrides import distributed as overrides_distributed
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call as trainer_call
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException


class PrivateName(NamedTuple):
    owner: Any
    name: str
    why: str


PRIVATE_NAMES = [
    PrivateName(
        trainer_call, "_call_callback_hooks", "calls a callback's hook only when it is callable (LeanCallback)"
    ),
    PrivateName(DDPStrategy, "_configure_launcher", "LitDDPStrategy tells its ranks who launched them"),
    PrivateName(DDPStrategy, "_register_ddp_hooks", "LitDDPStrategy registers comm hooks on gloo too"),
    PrivateName(DDPStrategy, "_setup_model", "LitDDPStrategy builds DDP on the default CUDA stream outside a capture"),
    PrivateName(DDPStrategy, "_ddp_comm_hook", "the hook, wrapper and state given to DDPStrategy(...)"),
    PrivateName(DDPStrategy, "_ddp_comm_wrapper", "see _ddp_comm_hook"),
    PrivateName(DDPStrategy, "_ddp_comm_state", "see _ddp_comm_hook"),
    PrivateName(
        DDPStrategy,
        "_ddp_kwargs",
        "DDP's arguments as given to DDPStrategy(**kwargs): DDP is built from them; the tuner starts there",
    ),
    PrivateName(DDPStrategy, "_launcher", "the launcher the strategy configured (None in launched ranks)"),
    PrivateName(DDPStrategy, "_start_method", "the start method the launcher is configured with"),
    PrivateName(DDPStrategy, "_timeout", "the process-group timeout DDPStrategy(timeout=...) was given"),
    PrivateName(Strategy, "_checkpoint_io", "the CheckpointIO given (None: none yet), as the Trainer reads it"),
    PrivateName(_SubprocessScriptLauncher, "procs", "the `ddp` launcher's Popen list of ranks 1..N-1"),
    PrivateName(_SubprocessScriptLauncher, "_call_children_scripts", "ScriptLauncher: the children get its pid"),
    PrivateName(_MultiProcessingLauncher, "procs", "the ddp_spawn/fork launcher's processes"),
    PrivateName(_MultiProcessingLauncher, "get_extra_results", "CarryBackLauncher adds the callbacks' carried_back"),
    PrivateName(_MultiProcessingLauncher, "update_main_process_results", "... and sets them in the launcher"),
    PrivateName(_SignalConnector, "_sigterm_notifier_fn", "the SIGTERM handler Lightning registers in fit"),
    PrivateName(Trainer, "_signal_connector", "the trainer's signal connector"),
    PrivateName(_SignalConnector, "_slurm_sigusr_handler_fn", "Lightning's SLURM requeue: HPC checkpoint, scontrol"),
    PrivateName(_TrainingEpochLoop, "_broadcast_sigterm_tensor", "Lightning's per-step SIGTERM broadcast"),
    PrivateName(overrides_distributed, "_register_ddp_comm_hook", "Lightning's helper: hook + wrapper onto DDP"),
    PrivateName(_FitLoop, "_data_source", "where fit's training data comes from, before the loop sets it up"),
    PrivateName(DDPStrategy, "_timeout", "the process group's timeout given to DDPStrategy(timeout=...)"),
    PrivateName(_MultiProcessingLauncher, "_wrapping_function", "a ddp_fork/spawn rank's fit: its exception hooks"),
    PrivateName(trainer_call, "_interrupt", "what Lightning runs on an exception (on_exception hooks), in a rank"),
    PrivateName(_FitLoop, "_data_fetcher", "fit's data fetcher: how many batches each rank still has (uneven data)"),
    PrivateName(
        _PrefetchDataFetcher, "batches", "the fetcher's batches fetched ahead (an unsized loader's look-ahead)"
    ),
    PrivateName(_PrefetchDataFetcher, "prefetch_batches", "how many it fetches ahead at each epoch's start"),
    PrivateName(_DataFetcher, "iterator", "the loader's iterator it refills from (emptied where the epoch ends)"),
    PrivateName(DDPStrategy, "_get_process_group_backend", "nccl or gloo, before the group is made (NCCL's dumps)"),
]


# The launchers, by public names, for lit_ddp/run/launchers.py to subclass.
SubprocessScriptLauncher = _SubprocessScriptLauncher
MultiProcessingLauncher = _MultiProcessingLauncher


def launcher_of(strategy: DDPStrategy) -> Any:
    """The launcher the strategy configured (``None`` before ``_configure_launcher``, and in launched ranks)."""
    return strategy._launcher


def set_launcher(strategy: DDPStrategy, launcher: Any) -> None:
    strategy._launcher = launcher


def start_method(strategy: DDPStrategy) -> str:
    """The start method the strategy's launcher is made with (``popen``, ``spawn``, ``fork``, ``forkserver``)."""
    return strategy._start_method


def train_dataloader(trainer: Trainer) -> Any:
    """The training data as ``fit`` was given it: the datamodule's or the module's ``train_dataloader``, or the
    loaders passed to ``fit`` (before the fit loop has set them up: usable in ``on_fit_start``)."""
    return trainer.fit_loop._data_source.dataloader()


def batches_ahead(trainer: Trainer, at_least: int) -> Optional[int]:
    """For an unsized training loader (an ``IterableDataset``): how many batches this rank has after the current
    one, counted up to ``at_least`` (so ``at_least`` means that many or more); None for a sized loader (its length
    says it). Lightning's fetcher knows one batch ahead (``prefetch_batches=1``): it is topped up here to
    ``at_least`` and fetches as many ahead from the next epoch on."""
    fetcher = trainer.fit_loop._data_fetcher
    if not isinstance(fetcher, _PrefetchDataFetcher) or fetcher.length is not None:
        return None
    fetcher.prefetch_batches = max(fetcher.prefetch_batches, at_least)
    while len(fetcher.batches) < at_least and not fetcher.done:
        try:  # the loader's own iterator, not the fetcher's __next__, which would hand a batch on
            fetcher.batches.append(next(fetcher.iterator))
        except StopIteration:  # exhausted: the fetcher's next refill raises again and it sets done
            break
    return min(len(fetcher.batches), at_least)


def end_epoch_after(trainer: Trainer, batches: int) -> None:
    """This rank's epoch ends ``batches`` batches after the current one, wherever its loader would: sized, as
    ``limit_train_batches`` ends it (``max_batches``, and the batch that validates); unsized, its fetcher keeps
    that many batches and no more, so that Lightning sees the last one as the last (``is_last_batch``)."""
    fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    end = epoch_loop.batch_idx + 1 + batches
    fetcher = fit_loop._data_fetcher
    if isinstance(fetcher, _PrefetchDataFetcher) and fetcher.length is None:
        del fetcher.batches[batches:]
        fetcher.iterator = iter(())
    elif end < fit_loop.max_batches:
        fit_loop.max_batches = end
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch not in (None, float("inf")):
            trainer.val_check_batch = max(1, int(end * trainer.val_check_interval))  # as Lightning's setup_data
    if batches == 0:  # the current batch is the last: set before the step decides to accumulate or to step
        epoch_loop.batch_progress.is_last_batch = True


def process_group_backend(strategy: Any) -> str:
    """The backend the strategy will make its process group with (``nccl``, ``gloo``, ...), before it does; ``""``
    for a strategy that makes none."""
    get = getattr(strategy, "_get_process_group_backend", None)
    return get() if get is not None else ""


def process_group_timeout(strategy: Any) -> Optional[timedelta]:
    """The timeout ``DDPStrategy(timeout=...)`` was given (Lightning's default: torch's 30 minutes)."""
    return getattr(strategy, "_timeout", None)


def is_lightning_launcher(launcher: Any) -> bool:
    """The ``ddp`` (popen) and ``ddp_spawn``/``ddp_fork`` launchers start ranks themselves; torchrun/Slurm don't."""
    return isinstance(launcher, (_SubprocessScriptLauncher, _MultiProcessingLauncher))


def launched_ranks(strategy: DDPStrategy) -> Optional[list]:
    """The ``ddp`` launcher's child processes (ranks 1..N-1 of this node), or None under any other launcher."""
    launcher = strategy._launcher
    return launcher.procs if isinstance(launcher, _SubprocessScriptLauncher) else None


def launched_pids(strategy: DDPStrategy) -> list[int]:
    """Pids of the ranks this process started, under any Lightning launcher (empty before launch)."""
    launcher = strategy._launcher
    return [p.pid for p in launcher.procs] if is_lightning_launcher(launcher) else []


def trains_in_children(strategy: DDPStrategy) -> bool:
    """``ddp_fork``/``ddp_spawn``: this process only launches and waits; every rank is a child process."""
    return isinstance(strategy._launcher, _MultiProcessingLauncher)


class CommHook(NamedTuple):
    hook: Optional[Callable]
    wrapper: Optional[Callable]
    state: Any


def configured_comm_hook(strategy: DDPStrategy) -> CommHook:
    """The comm hook, wrapper and state given to ``DDPStrategy(ddp_comm_hook=..., ...)``."""
    return CommHook(strategy._ddp_comm_hook, strategy._ddp_comm_wrapper, strategy._ddp_comm_state)


def ddp_kwargs(strategy: DDPStrategy) -> dict[str, Any]:
    """The ``DistributedDataParallel`` options given to ``DDPStrategy(**kwargs)`` (any DDPStrategy, ours or not)."""
    if not hasattr(strategy, "_ddp_kwargs"):
        raise RuntimeError("lightning changed: DDPStrategy keeps no _ddp_kwargs (the DDP options it was given)")
    return dict(strategy._ddp_kwargs)


def set_comm_hook(strategy: DDPStrategy, hook: Optional[Callable], wrapper: Optional[Callable] = None) -> None:
    """Replaces the hook Lightning will register when it wraps the model (``strategy.setup``)."""
    strategy._ddp_comm_hook, strategy._ddp_comm_wrapper = hook, wrapper


def register_comm_hook(model: Any, state: Any, hook: Optional[Callable], wrapper: Optional[Callable]) -> None:
    """Lightning's helper: ``model.register_comm_hook(state, wrapper(hook))`` with its checks."""
    overrides_distributed._register_ddp_comm_hook(model, ddp_comm_state=state, ddp_comm_hook=hook,
                                                  ddp_comm_wrapper=wrapper)  # fmt: skip


def replace_sigterm_notifier(trainer: Trainer, notifier: Callable) -> None:
    """Lightning registers ``_sigterm_notifier_fn`` as its SIGTERM handler in ``fit``; set before that (``setup``)."""
    trainer._signal_connector._sigterm_notifier_fn = notifier


def replace_requeue_handler(trainer: Trainer, handler: Callable) -> Callable:
    """Lightning registers ``_slurm_sigusr_handler_fn`` for Slurm's requeue signal in ``fit`` (auto-requeue on);
    set before that (``setup``). Returns Lightning's own, which saves the HPC checkpoint on every rank and has
    rank 0 run ``scontrol requeue``: the caller runs it where every rank can, at a step boundary."""
    connector = trainer._signal_connector
    original = type(connector)._slurm_sigusr_handler_fn.__get__(connector)
    connector._slurm_sigusr_handler_fn = handler
    return original


def disable_sigterm_broadcast(trainer: Trainer) -> None:
    """Lightning 2.6 broadcasts the SIGTERM flag at the top of every step and reads it on the host
    (lightning#21487; lightning#21640 would make it ``broadcast_sigterm_every_n_steps``, unmerged). The
    caller carries the flag in its own per-step collective instead."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        raise RuntimeError("lightning changed: _TrainingEpochLoop._broadcast_sigterm_tensor is gone")
    epoch_loop._broadcast_sigterm_tensor = lambda: None


CARRIED_BACK = "lit_ddp.carried_back"  # the key of the callbacks' attributes in the worker output's ``extra``


class CarryBackLauncher(_MultiProcessingLauncher):
    """Lightning's ``ddp_fork``/``ddp_spawn`` launcher that also carries back to the launching process, from
    rank 0, the attributes each callback names in its ``carried_back`` (Lightning carries ``callback_metrics``
    only): how StepSync saw training end when a SIGTERM reached a rank and not the launcher."""

    def get_extra_results(self, trainer: Trainer) -> dict[str, Any]:
        carried = {type(c).__qualname__: {name: getattr(c, name) for name in getattr(c, "carried_back", ())}
                   for c in trainer.callbacks}  # fmt: skip
        return {**super().get_extra_results(trainer), CARRIED_BACK: carried}

    def launch(self, function: Callable, *args: Any, trainer: Optional[Trainer] = None, **kwargs: Any) -> Any:
        # Each rank that fails leaves its traceback and the time here: the job ends with the first cause.
        self.failures = tempfile.mkdtemp(prefix="lit_ddp-failures-")
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessRaisedException as err:
            first = first_failure(Path(self.failures))
            if first is None or first.rank == err.error_index:
                raise
            raise ProcessRaisedException(first.message, first.rank, first.pid) from None
        except ProcessExitedException as err:  # killed, before any Python handler ran (NCCL's watchdog aborts)
            why = self.why_exited()
            if why is None:
                raise
            exited = ProcessExitedException(f"{why}: {err}", err.error_index, err.error_pid, err.exit_code,
                                            err.signal_name)  # fmt: skip
            exited.lit_ddp_diagnosis = why
            raise exited from None
        finally:
            shutil.rmtree(self.failures, ignore_errors=True)

    def why_exited(self) -> Optional[str]:
        """Why a rank was killed, from what the ranks left behind (``lit_ddp.run.launchers``: NCCL's dumps)."""
        return None

    def _wrapping_function(self, process_idx: int, trainer: Optional[Trainer], *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(process_idx, trainer, *args, **kwargs)
        except Exception as err:
            failed_at = time.time()
            if trainer is not None:  # as a `ddp` rank does: on_exception of the callbacks and of the strategy
                try:
                    trainer_call._interrupt(trainer, err)
                except Exception:  # the rank's own error is what it ends with
                    pass
            leave_failure(Path(self.failures), process_idx, failed_at, getattr(err, "lit_ddp_consequence", False))
            raise

    def update_main_process_results(self, trainer: Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        carried = extra.get(CARRIED_BACK, {})
        for callback in trainer.callbacks:
            for name, value in carried.get(type(callback).__qualname__, {}).items():
                setattr(callback, name, value)


class Failure(NamedTuple):
    rank: int
    pid: int
    failed_at: float
    message: str  # as torch's spawn reports a rank's error: its traceback
    consequence: bool  # a peer's failure seen from here (a timeout, a closed connection: lit_ddp.run.hangs)


def leave_failure(directory: Path, rank: int, failed_at: float, consequence: bool) -> None:
    """In a failing rank, in its ``except``: its traceback, pid, time of failure and whether the error is a peer's
    failure seen from here, for ``first_failure``."""
    message = f"\n\n-- Process {rank} terminated with the following error:\n{traceback.format_exc()}"
    path = directory / f"rank{rank}.json"
    try:
        path.with_suffix(".tmp").write_text(
            json.dumps({"pid": os.getpid(), "failed_at": failed_at, "message": message, "consequence": consequence})
        )
        path.with_suffix(".tmp").replace(path)
    except OSError:  # the launcher's folder is gone: torch's own report remains
        pass


def first_failure(directory: Path) -> Optional[Failure]:
    """The failure the job ends with: the earliest of the ranks' own errors, else the earliest of the collective
    failures (a peer's timeout or closed connection is a consequence, even when its report arrived first)."""
    failures = []
    for path in directory.glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        failures.append(Failure(int(path.stem[4:]), data["pid"], data["failed_at"], data["message"],
                                data["consequence"]))  # fmt: skip
    own = [f for f in failures if not f.consequence]
    return min(own or failures, key=lambda f: f.failed_at, default=None)


# Lightning's hooks of a callback that run for every batch (training, validation, test, predict).
BATCH_HOOKS = (
    *("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step"),
    *("on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end"),
    *("on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end"),
)


class LeanCallback(Callback):
    """A ``Callback`` whose batch hooks that no class of it overrides are not called at all. Lightning calls every
    hook of every callback for every batch, each inside a profiler context (``trainer.call._call_callback_hooks``:
    ``fn = getattr(callback, hook_name); if callable(fn): with trainer.profiler.profile(...): fn(...)``), whether
    the hook does anything or not: the CLI's eight callbacks took some 0.2 ms of a host-bound step that way
    (docs/performance.md). Such a hook is ``None`` on the instance, which that dispatch passes over; a subclass
    that overrides it, and ``super()`` calls to the class's own, are untouched."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "LeanCallback":
        self = super().__new__(cls)
        for hook in BATCH_HOOKS:
            if getattr(cls, hook) is getattr(Callback, hook):
                setattr(self, hook, None)
        return self
