"""LossMonitor: which steps it prints and logs, that the value is the global mean, and the stop on NaN."""

import csv
import json
import logging
import re

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import LossMonitor, SyncCheck
from lit_ddp.run.checkpointing import LastCheckpoint
from tests.faults import NaNOnRank, StopAfterStep
from tests.recorders import RecordLogs
from tests.runner import STEP_LINE, run_main, step_losses, step_numbers

RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where rank_zero_info goes


def printed(caplog) -> str:
    return "\n".join(caplog.messages)


def fit_one_rank(make_trainer, tmp_path, monitor, max_steps=5, max_epochs=None, steps_per_epoch=100):
    """One rank in this process; returns the metrics.csv rows (none when nothing was logged)."""
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = make_trainer(devices=1, spawn=False, max_steps=max_steps, max_epochs=max_epochs, callbacks=[monitor],
                           logger=logger)  # fmt: skip
    trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4, steps_per_epoch=steps_per_epoch))
    metrics = tmp_path / "run" / "version_0" / "metrics.csv"
    if not metrics.exists():
        return []
    with open(metrics) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "max_steps, max_epochs, steps_per_epoch",
    [(6, None, 100), (-1, 2, 3)],
    ids=["max_steps", "last_batch_of_the_last_epoch"],
)
def test_prints_every_n_th_step_and_always_the_last(make_trainer, tmp_path, caplog, max_steps, max_epochs,
                                                    steps_per_epoch):  # fmt: skip
    with caplog.at_level(logging.INFO, logger=RANK_ZERO_LOGGER):
        fit_one_rank(make_trainer, tmp_path, LossMonitor(every_n_steps=4), max_steps, max_epochs, steps_per_epoch)
    assert step_numbers(printed(caplog)) == [0, 4, 5]  # both runs have 6 steps


def test_by_default_it_prints_every_log_every_n_steps_of_the_trainer(tmp_path, caplog):
    """In a user's script LossMonitor() prints at Lightning's cadence for step metrics, not every step."""
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=8, log_every_n_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[LossMonitor()], default_root_dir=tmp_path)  # fmt: skip
    with caplog.at_level(logging.INFO, logger=RANK_ZERO_LOGGER):
        trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))
    assert step_numbers(printed(caplog)) == [0, 3, 6, 7]  # and the last step


def test_every_n_steps_0_prints_and_logs_nothing(make_trainer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=RANK_ZERO_LOGGER):
        rows = fit_one_rank(make_trainer, tmp_path, LossMonitor(every_n_steps=0))
    assert "Step " not in printed(caplog)
    assert not any(row.get("train/loss") for row in rows)


def test_train_loss_is_logged_on_the_printed_steps(make_trainer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=RANK_ZERO_LOGGER):
        rows = fit_one_rank(make_trainer, tmp_path, LossMonitor(every_n_steps=2), max_steps=5)
    logged = {int(row["step"]): float(row["train/loss"]) for row in rows if row.get("train/loss")}
    assert list(logged) == step_numbers(printed(caplog)) == [0, 2, 4]
    assert [round(loss, 4) for loss in logged.values()] == step_losses(printed(caplog))


class RecordLocalLoss(Callback):
    """Writes each rank's own loss of every step to ``rank<r>.json``."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module):
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.losses))


def test_the_loss_is_the_mean_over_the_ranks(make_trainer, tmp_path):
    trainer = make_trainer(max_steps=3, callbacks=[RecordLocalLoss(tmp_path), LossMonitor(every_n_steps=1)],
                           logger=CSVLogger(tmp_path, name="run", version=0))  # fmt: skip
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    local = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        logged = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert all(abs(a - b) > 1e-3 for a, b in zip(*local, strict=True)), "the ranks' shards must differ"
    assert logged == pytest.approx([(a + b) / 2 for a, b in zip(*local, strict=True)], rel=1e-6)


class RecordStepStarts(Callback):
    """Every rank writes the last step it started to ``rank<r>.step``."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        (self.out_dir / f"rank{trainer.global_rank}.step").write_text(str(trainer.global_step))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_loss_on_one_rank_stops_every_rank_at_the_next_step(make_trainer, tmp_path, value):
    monitor = LossMonitor(every_n_steps=0)  # printing off: the check does not depend on it
    trainer = make_trainer(max_steps=6, callbacks=[RecordStepStarts(tmp_path), NaNOnRank(1, 2, value), monitor])
    message = f"loss is {value} at step 2: non-finite on rank(s) [1]; training stopped"
    with pytest.raises(Exception, match=re.escape(message)):
        trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    # The step's gather is read at the end of the next step (StepSync): every rank stops there, together.
    assert [(tmp_path / f"rank{rank}.step").read_text() for rank in (0, 1)] == ["3", "3"]


def test_bad_arguments_are_refused(monkeypatch, capsys):
    with pytest.raises(ValueError, match=re.escape("`LossMonitor(every_n_steps=-1)` must be >= 0")):
        LossMonitor(every_n_steps=-1)
    result = run_main(monkeypatch, capsys, "--loss_monitor.every_n_steps", "-1")
    assert result.returncode == 2
    assert re.fullmatch(r"lit-ddp-fit: error: .*loss_monitor\.every_n_steps.*-1.*", result.stderr.strip())
    assert not STEP_LINE.search(result.stdout)


def test_a_nan_step_is_never_checkpointed(make_trainer, tmp_path):
    # Checkpoints every step: step 2's save must wait for step 2's gather (read one step later otherwise) and
    # stop there, leaving the checkpoint of step 1 (global_step 2) on disk.
    checkpoint = LastCheckpoint(every_n_steps=1, dirpath=str(tmp_path / "ckpt"))
    trainer = make_trainer(max_steps=6, callbacks=[NaNOnRank(rank=1, step=2), LossMonitor(every_n_steps=0), checkpoint])
    with pytest.raises(Exception, match=re.escape("loss is nan at step 2")):
        trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in saved["state_dict"].values())


def test_training_stopped_with_the_last_gather_in_flight_ends_with_that_steps_line_row_and_check(make_trainer,
                                                                                               tmp_path):  # fmt: skip
    """A callback after StepSync stops training after step 2, whose gather is then still in flight: its Step line,
    its logger row and the weights after it (SyncCheck had checked step 0 only) are all there at the end."""
    callbacks = [RecordLogs(tmp_path), LossMonitor(every_n_steps=1), SyncCheck(), StopAfterStep(2)]
    trainer = make_trainer(max_steps=10, callbacks=callbacks, logger=CSVLogger(tmp_path, name="run", version=0))
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        assert [row["step"] for row in csv.DictReader(f) if row.get("train/loss")] == ["0", "1", "2"]
    log = RecordLogs.read(tmp_path, 0)
    assert "Step 2, Loss" in log and "Step 3," not in log, log
    assert "weights in sync across 2 ranks after step 2:" in log, log
