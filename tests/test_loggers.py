"""The tool's metrics reach every logger of the Trainer, as Lightning's own DeviceStatsMonitor's do: the rows of each
step while the fit runs, and at its end the run's analysis as one row (``lit_ddp.present.loggers``)."""

import csv
from dataclasses import replace

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer
from lit_ddp.derive.memory import StepMemoryFigures
from lit_ddp.present.loggers import logger_row
from lit_ddp.records.schema import Sketch, StepBuckets, load_run
from tests import records

METRICS = {"train/loss", "time/step_ms", "time/backward_ms", "comm/busy_ms", "comm/bytes"}
# The end of fit's row of this 2-rank run (no straggler, no memory measured on CPU without the profiler).
AT_THE_END = {"fit/step_ms", "fit/forward_ms", "fit/backward_ms", "fit/update_ms", "fit/data_ms", "fit/other_ms",
              "fit/exposed_ms", "fit/wait_ms"}  # fmt: skip


def test_a_csv_and_a_tensorboard_logger_both_get_the_metrics(make_trainer, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    loggers = [CSVLogger(tmp_path, name="csv", version=0), TensorBoardLogger(tmp_path, name="tb", version=0)]
    callbacks = [LossMonitor(every_n_steps=1), PhaseTimer(print_steps=0), CommMonitor()]
    trainer = make_trainer(max_steps=4, logger=loggers, callbacks=callbacks)
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))

    run_dir = tmp_path / "csv" / "version_0"
    with open(run_dir / "metrics.csv", newline="") as f:
        logged = list(csv.DictReader(f))
    for name in METRICS:
        assert sorted(int(row["step"]) for row in logged if row.get(name)) == [0, 1, 2, 3], name
    # The end of fit's row: once, after the last step, rendered from the analysis of the record it wrote.
    (end,) = [row for row in logged if row.get("fit/step_ms")]
    expected = logger_row(analyze(*load_run(run_dir)))
    assert set(expected) == AT_THE_END and int(end["step"]) == 4
    assert {name: float(end[name]) for name in expected} == pytest.approx(expected, rel=1e-12)

    events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    for name in METRICS:
        assert [event.step for event in events.Scalars(name)] == [0, 1, 2, 3], name
    for name, value in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(name)] == [(4, pytest.approx(value, rel=1e-6))], name


@pytest.mark.timeout(10)
def test_the_row_names_the_straggler_and_the_memory_peak_where_the_analysis_has_them():
    def row(rank: int, step: int) -> StepBuckets:  # rank 1 arrives 500 ms after rank 0 at every all-reduce
        return StepBuckets(step, [1000], [2.0], [0.0], 2.0, 2.0, [step + 0.5 * rank])

    comm = records.comm_record([[row(r, s) for s in range(8)] for r in (0, 1)], param_bytes=1000)
    phases = records.phase_record([[(1.0, 501.0, 1.0, 1.0)] * 8, [(501.0, 1.0, 1.0, 1.0)] * 8])
    analysis = analyze(phases, comm)
    logged = logger_row(analysis)
    assert logged["fit/step_ms"] == analysis.step_ms == pytest.approx(504.0, rel=0.01)
    assert (logged["fit/straggler_rank"], logged["fit/straggler_late_ms"]) == (1.0, pytest.approx(500.0, rel=0.01))
    assert "fit/peak_memory_bytes" not in logged  # no memory measured
    peaks = {"step": Sketch.of([3e6, 5e6, 4e6])}
    memory = StepMemoryFigures(1, "cuda_allocator", peaks, {}, Sketch.of([1e6]), [2, 3, 4])
    with_memory = logger_row(replace(analysis, memory=memory))
    assert with_memory["fit/peak_memory_bytes"] == pytest.approx(4e6, rel=Sketch.RELATIVE_ACCURACY)
    assert with_memory["fit/peak_memory_rank"] == 1.0
    assert logger_row(analyze(None, comm)) == {}  # no phase record, no row
