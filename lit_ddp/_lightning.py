"""Every private Lightning name that lit_ddp relies on, in one place, each with what it relies on: the register
(``PRIVATE_NAMES``) and the accessors that reach them, nothing else.

    pytest tests/test_private_apis.py      # fails loudly, naming the name, when the installed Lightning changed

Tested with lightning 2.6 (pyproject allows >=2.6,<2.7). ``lit_ddp/run/strategy.py`` overrides three private
methods of ``DDPStrategy`` (``_configure_launcher``, ``_setup_model``, ``_register_ddp_hooks``) and sets its
``_start_method`` before the launcher is made; ``lit_ddp/run/launchers.py`` and ``lit_ddp/run/spawn_launcher.py``
subclass the two launchers (exported here under public names) and override ``_call_children_scripts`` and
``_wrapping_function``; everything else private is reached through the functions below and nowhere else.
"""

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities import distributed as fabric_distributed
from lightning.pytorch import Trainer
from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.overrides import distributed as overrides_distributed
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call as trainer_call
from lightning.pytorch.trainer.connectors.logger_connector import result as logged_results
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector


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
    PrivateName(
        logged_results, "_ResultMetric", "a logged key as Lightning reduces it: its meta's name, hook (fx) and sync"
    ),
    PrivateName(
        fabric_distributed, "_InfiniteBarrier", "the barrier around prepare_data: the watchdog names a rank in it"
    ),
    PrivateName(_ChildProcessObserver, "_terminate_all", "the `ddp` launcher's SIGKILL of every rank and itself"),
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


def prefetcher(trainer: Trainer) -> Optional[_PrefetchDataFetcher]:
    """Fit's data fetcher when it fetches ahead (an unsized loader's: its ``batches``, ``prefetch_batches``,
    ``iterator``, ``length`` and ``done``), else None."""
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher if isinstance(fetcher, _PrefetchDataFetcher) else None


def interrupt(trainer: Trainer, error: BaseException) -> None:
    """What Lightning runs on an exception in a ``ddp`` rank (the callbacks' and the strategy's ``on_exception``)."""
    trainer_call._interrupt(trainer, error)


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


def waits_at_prepare_data_barrier(frame: Any) -> bool:
    """``frame`` (a thread's innermost Python frame) waits in Lightning's barrier around ``prepare_data``: a gloo
    group of its own with a 10,000-day timeout, which opens when every rank has come (``_InfiniteBarrier``)."""
    return frame is not None and isinstance(frame.f_locals.get("self"), fabric_distributed._InfiniteBarrier)


def launched_ranks(strategy: DDPStrategy) -> Optional[list]:
    """The ``ddp`` launcher's child processes (ranks 1..N-1 of this node), or None under any other launcher."""
    launcher = strategy._launcher
    return launcher.procs if isinstance(launcher, _SubprocessScriptLauncher) else None


def before_the_observer_kills(action: Callable[[], None]) -> None:
    """Lightning's child-process observer (a thread of rank 0 of its ``ddp`` launcher) SIGKILLs every rank and this
    process when one rank exits with an error: ``action`` runs first (once, however often this is called)."""
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and not getattr(thread, "lit_ddp_first", False):
            thread._terminate_all, thread.lit_ddp_first = _first(action, thread._terminate_all), True


def _first(action: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        action()
        then()

    return both


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


class Reduced(NamedTuple):
    """A logged key that Lightning reduces across the ranks (``sync_dist=True``) where a thread waits."""

    key: str  # as the user logged it: ``self.log("epoch_metric", ...)``
    hook: str  # the hook it was logged in (``on_train_epoch_end``)
    owners: tuple[type, ...]  # the classes that hook may be in: the LightningModule's, the callbacks'


def reduced_on(frame: Any) -> Optional[Reduced]:
    """The key whose ``sync_dist`` reduction a thread waits in (a ``_ResultMetric``'s ``update``, or its ``compute``
    which Lightning runs after the hook returned, from its loop), read from the thread's stack, innermost first;
    None where no such reduction is on it."""
    reduced, trainer = None, None
    while frame is not None and trainer is None:
        owner = frame.f_locals.get("self")
        if reduced is None and isinstance(owner, logged_results._ResultMetric):
            reduced = owner.meta
        trainer = owner if isinstance(owner, Trainer) else None
        frame = frame.f_back
    if reduced is None or not reduced.sync.should:
        return None
    owners = () if trainer is None else (type(trainer.lightning_module), *map(type, trainer.callbacks))
    return Reduced(reduced.name, reduced.fx, owners)
