"""The tool's metrics reach every logger of the Trainer, as Lightning's own DeviceStatsMonitor's do."""

import csv

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer

METRICS = {"train/loss", "time/step_ms", "time/backward_ms", "comm/busy_ms", "comm/bytes"}


def test_a_csv_and_a_tensorboard_logger_both_get_the_metrics(make_trainer, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    loggers = [CSVLogger(tmp_path, name="csv", version=0), TensorBoardLogger(tmp_path, name="tb", version=0)]
    callbacks = [LossMonitor(every_n_steps=1), PhaseTimer(print_steps=0), CommMonitor()]
    trainer = make_trainer(max_steps=4, logger=loggers, callbacks=callbacks)
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))

    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:
        logged = list(csv.DictReader(f))
    for name in METRICS:
        assert sorted(int(row["step"]) for row in logged if row.get(name)) == [0, 1, 2, 3], name

    events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    for name in METRICS:
        assert [event.step for event in events.Scalars(name)] == [0, 1, 2, 3], name
