"""The ``ddp_fork``/``ddp_spawn`` launcher lit_ddp's strategy uses (``CarryBackLauncher``): Lightning's, that also
carries the callbacks' ``carried_back`` attributes to the launching process and ends the job with the first
failing rank's own error (the failure files each failing rank leaves).

    python -m lit_ddp.fit --devices 2        # on one Linux machine, with CPUs: ddp_fork, through this launcher

Lightning's launcher is reached by its public name in ``lit_ddp._lightning`` (``MultiProcessingLauncher``); the
private method it overrides (``_wrapping_function``) is in that register. docs/failures.md.
"""

import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Optional

from lightning.pytorch import Trainer
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from lit_ddp import _lightning

CARRIED_BACK = "lit_ddp.carried_back"  # the key of the callbacks' attributes in the worker output's ``extra``


class CarryBackLauncher(_lightning.MultiProcessingLauncher):
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
                    _lightning.interrupt(trainer, err)
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
