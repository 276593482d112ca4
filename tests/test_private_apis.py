"""Every private Lightning and torch name lit_ddp relies on still exists in the installed Lightning and torch.

When one of these fails, Lightning or torch changed under us: the message names the name and what lit_ddp uses
it for (``lit_ddp/_lightning.py``, ``lit_ddp/_torch.py``); adapt that module (and pyproject's ranges) first.
"""

import inspect

import lightning
import pytest
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from lit_ddp import _lightning, _torch
from lit_ddp.run.lean import LeanCallback


def has_name(owner, name: str) -> bool:
    if hasattr(owner, name):
        return True
    if not inspect.isclass(owner):
        return False
    # Instance attributes set in __init__ (or in the methods that set them) show in the class's source.
    return any(f"self.{name} " in line or f"self.{name}:" in line for line in inspect.getsource(owner).splitlines())


@pytest.mark.parametrize(
    "private", _lightning.PRIVATE_NAMES, ids=lambda p: f"{getattr(p.owner, '__name__', '')}.{p.name}"
)
def test_private_lightning_name_still_exists(private):
    assert has_name(private.owner, private.name), (
        f"lightning {lightning.__version__} has no {getattr(private.owner, '__name__', 'module')}.{private.name}; "
        f"lit_ddp relies on it: {private.why}"
    )


@pytest.mark.parametrize("private", _torch.PRIVATE_NAMES, ids=lambda p: f"{p.owner.__name__}.{p.name}")
def test_private_torch_name_still_exists(private):
    if private.name.startswith(("_cuda", "_dump_nccl")) and torch.version.cuda is None:
        pytest.skip("a CPU build of torch has no CUDA bindings")
    assert has_name(private.owner, private.name), (
        f"torch {torch.__version__} has no {private.owner.__name__}.{private.name}; lit_ddp relies on it: {private.why}"
    )


def test_a_name_that_is_gone_fails():
    assert not has_name(_lightning.overrides_distributed, "_no_such_helper")
    assert not has_name(DDPStrategy, "_no_such_attribute")


def test_the_loop_still_broadcasts_sigterm_where_step_sync_disables_it():
    source = inspect.getsource(_TrainingEpochLoop.advance)
    assert "self._broadcast_sigterm_tensor()" in source, "Lightning's per-step SIGTERM broadcast moved"


def test_the_signal_handler_is_still_the_one_step_sync_replaces():
    source = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "self._sigterm_notifier_fn" in source, "Lightning registers another SIGTERM handler now"


def test_launchers_still_keep_their_processes():
    for launcher in (_SubprocessScriptLauncher, _MultiProcessingLauncher):
        assert "self.procs" in inspect.getsource(launcher), f"{launcher.__name__} no longer has .procs"


def test_ddp_strategy_keeps_the_hook_and_wraps_in_the_methods_we_override():
    source = inspect.getsource(DDPStrategy)
    for name in ("_ddp_comm_hook", "_ddp_comm_wrapper", "_ddp_comm_state", "_start_method", "_launcher"):
        assert f"self.{name} = " in source, f"DDPStrategy no longer sets {name}"
    for method in ("_configure_launcher", "_setup_model", "_register_ddp_hooks"):
        assert method in DDPStrategy.__dict__, f"DDPStrategy.{method} is gone: LitDDPStrategy overrides it"


def test_lightning_passes_over_the_batch_hooks_a_lean_callback_does_not_override():
    """LeanCallback's hooks that no class of it overrides are None on the instance, and Lightning's dispatch skips
    them (no profiler context, no call); an overriding subclass and a ``super()`` call to the base's hook work."""
    from types import SimpleNamespace

    from lightning.pytorch import Callback
    from lightning.pytorch.profilers import PassThroughProfiler
    from lightning.pytorch.trainer import call

    calls = []

    class Profiler(PassThroughProfiler):
        def start(self, action_name):
            calls.append(action_name.rpartition("<locals>.")[2])  # the hook's callback, by its state key

    class Lean(LeanCallback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            calls.append("Lean.on_train_batch_end")

    class Users(Lean):
        def on_before_backward(self, trainer, pl_module, loss):
            calls.append("Users.on_before_backward")
            super().on_before_backward(trainer, pl_module, loss)  # the base's own: Callback's no-op

    lean, users = Lean(), Users()
    assert lean.on_before_backward is None and lean.on_train_start is not None  # a batch hook, and one that is not
    trainer = SimpleNamespace(lightning_module=None, callbacks=[lean, users], profiler=Profiler())
    call._call_callback_hooks(trainer, "on_before_backward", None)
    assert calls == ["Users.on_before_backward"] * 2  # once the profiler's, once its own
    calls.clear()
    call._call_callback_hooks(trainer, "on_train_batch_end", None, None, 0)
    assert calls == ["Lean.on_train_batch_end", "Lean.on_train_batch_end", "Users.on_train_batch_end",
                     "Lean.on_train_batch_end"]  # fmt: skip
    assert Callback.on_before_backward is not None  # the class itself is untouched


def test_before_lightnings_observer_kills_everything_our_action_runs_first():
    """A real observer thread (Lightning's ``ddp`` launcher starts one in rank 0), told to kill a stand-in process
    instead of this one: the action runs first, then Lightning's SIGKILL, and a second call wraps nothing again."""
    import subprocess

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    stand_in = subprocess.Popen(["sleep", "30"])
    observer = _ChildProcessObserver(main_pid=stand_in.pid, child_processes=[], sleep_period=3600)
    observer.start()
    seen = []
    _lightning.before_the_observer_kills(lambda: seen.append(stand_in.poll()))
    _lightning.before_the_observer_kills(lambda: seen.append("again"))
    observer._terminate_all()
    assert seen == [None]  # the stand-in still alive when the action ran, and one action only
    assert stand_in.wait(timeout=10) == -9
