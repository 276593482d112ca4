"""The end of training's one owner: ``EndOfFit``, the callback that, once every rank's records are on rank 0,
analyzes them once (``lit_ddp.analysis.run_analysis.analyze``), writes them, and renders the analysis
(``lit_ddp.present.end_of_fit``): its tables printed, its row given to every logger.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2   # its tables end the run

The record keepers (PhaseTimer, CommMonitor) add it to the Trainer and register with it (``owner``); it is the one
import of presentation by collection, named in pyproject's contract (docs/architecture.md#floors).
"""

from pathlib import Path
from typing import Optional, Protocol, Union

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lit_ddp.callbacks.shared import log_metrics, say
from lit_ddp.present.end_of_fit import detail_asked, render
from lit_ddp.records.schema import CommRecord, PhaseRecord
from lit_ddp.run import console
from lit_ddp.run.lean import LeanCallback


class RecordKeeper(Protocol):
    """A callback that ends with a part of the run's record on rank 0 (PhaseTimer, CommMonitor): what
    ``EndOfFit`` reads of it, so that it knows neither class."""

    record: Optional[Union[PhaseRecord, CommRecord]]
    log_dir: Optional[str]
    filename: str


class EndOfFit(LeanCallback):
    """Added to the Trainer by the first record keeper of a fit (``owner``), after every callback then in the
    Trainer: its ``on_train_end`` runs after theirs, when their records are on rank 0. There, and there only, the
    run is analyzed, its records written, its tables printed and its row logged (at the fit's final ``global_step``)."""

    def __init__(self) -> None:
        self._keepers: dict[int, RecordKeeper] = {}

    def expect(self, keeper: RecordKeeper) -> None:
        """``keeper`` will hold its part of the record at the end of training."""
        self._keepers[id(keeper)] = keeper

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        keepers = [k for k in self._keepers.values() if k.record is not None]
        phases = next((k.record for k in keepers if isinstance(k.record, PhaseRecord)), None)
        comm = next((k.record for k in keepers if isinstance(k.record, CommRecord)), None)
        written = [(Path(k.log_dir) / k.filename, k.record) for k in keepers if k.log_dir is not None]
        rendered = render(phases, comm, written, console.advice(trainer), detail_asked())
        for text in rendered.texts:
            say(trainer, text)
        if rendered.logged:
            log_metrics(trainer, rendered.logged, step=trainer.global_step)


def owner(trainer: Trainer) -> EndOfFit:
    """The Trainer's ``EndOfFit``, added to its callbacks the first time a record keeper asks (from its ``setup``
    or ``on_train_start``: Lightning iterates ``trainer.callbacks`` afresh for every hook)."""
    found = next((c for c in trainer.callbacks if isinstance(c, EndOfFit)), None)
    if found is None:  # added to the user's Trainer (docs/callbacks.md lists every callback the tool adds)
        found = EndOfFit()
        trainer.callbacks.append(found)
    return found
