"""Lightning's launchers as ``LitDDPStrategy`` uses them: the ranks they start know their launcher's pid (to die
with it), the cluster's settings a usage error, and how the ranks' training ended carried back to a launching
parent.

    python -m lit_ddp.fit --devices 2      # ddp_fork on CPUs: MultiProcessingLauncher; on GPUs: ScriptLauncher

Under NCCL both set, before the ranks start, what NCCL's Flight Recorder needs to dump on a timeout into the run's
folder (``lit_ddp.run.hangs.prepare_nccl_dumps``); a ``ddp_spawn`` launcher whose rank was killed (NCCL's watchdog
aborts it) names the divergence that those dumps show.

Both only add to Lightning's: they launch when and as Lightning does, inside ``trainer.fit``.
"""

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from typing_extensions import override

from lit_ddp import _lightning
from lit_ddp.errors import ClusterSettingsError
from lit_ddp.run import hangs, lifecycle, spawn_launcher, watchdog


class ScriptLauncher(_lightning.SubprocessScriptLauncher):
    """Lightning's ``ddp`` launcher (it runs the script again for ranks 1..N-1, or nothing under torchrun and
    Slurm). A cluster whose settings disagree with the Trainer's (a Slurm job whose ``--ntasks-per-node`` is not
    ``--devices``) is refused where Lightning refuses it, before any rank trains, as a ``ClusterSettingsError``:
    still Lightning's ``ValueError``, and one line with exit 2 from ``python -m lit_ddp.fit``, not a traceback
    from every task."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        try:
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        except ValueError as err:
            raise ClusterSettingsError(str(err)) from err
        if trainer is not None:  # each rank under torchrun and Slurm; rank 0, for the ranks it starts, under `ddp`
            hangs.prepare_nccl_dumps(_lightning.process_group_backend(trainer.strategy), trainer.default_root_dir)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        with lifecycle.launcher_pid_for_children():
            super()._call_children_scripts()


class MultiProcessingLauncher(spawn_launcher.CarryBackLauncher):
    """Lightning's ``ddp_fork``/``ddp_spawn`` launcher, carrying the callbacks' ``carried_back`` state home; the
    ranks it starts know their launcher's pid."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        self.started, self.dumps = time.time(), None
        if trainer is not None:
            self.dumps = hangs.prepare_nccl_dumps(_lightning.process_group_backend(trainer.strategy),
                                                  trainer.default_root_dir)  # fmt: skip
        with lifecycle.launcher_pid_for_children():
            return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def why_exited(self) -> Optional[str]:
        ended = Path(watchdog.ended_file(os.getpid()))  # a rank's watchdog ended the job: its line
        if ended.is_file():
            line = ended.read_text()
            ended.unlink(missing_ok=True)
            return line
        return hangs.dumps_diagnosis(self.dumps, self.started)


def replace_launcher(strategy) -> None:
    """Right after ``DDPStrategy._configure_launcher``: Lightning's launcher becomes the one above that adds to it.
    A launcher of another kind (a test's or a user's subclass) is left as it is."""
    launcher = _lightning.launcher_of(strategy)
    if type(launcher) is _lightning.SubprocessScriptLauncher:
        _lightning.set_launcher(strategy, ScriptLauncher(launcher.cluster_environment, launcher.num_processes,
                                                         launcher.num_nodes))  # fmt: skip
    elif type(launcher) is _lightning.MultiProcessingLauncher:
        _lightning.set_launcher(
            strategy, MultiProcessingLauncher(strategy, start_method=_lightning.start_method(strategy))
        )
