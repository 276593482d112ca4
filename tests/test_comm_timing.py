"""CommMonitor's timing of a real 2-rank run, where the all-reduce is made slow on purpose: each bucket's ready
time is its hand-over to the comm hook, not the end of its all-reduce."""

from lightning.pytorch.loggers import CSVLogger

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, PhaseTimer
from lit_ddp.records.schema import load_run
from tests.faults import slow_allreduce_hook


def test_ready_time_is_the_hand_over_and_the_all_reduce_time_follows_it(make_trainer, tmp_path):
    trainer = make_trainer(max_steps=4, callbacks=[PhaseTimer(print_steps=0), CommMonitor()],
                           logger=CSVLogger(tmp_path, name="run", version=0),
                           ddp_comm_hook=slow_allreduce_hook, bucket_cap_mb=0.25)  # fmt: skip
    trainer.fit(LinearRegression(dim=256, num_layers=3), FixedBatchDataModule(dim=256, batch_size=4))
    phases, comm = load_run(tmp_path / "run" / "version_0")
    assert len(comm.layout) == 3
    for rank in comm.ranks:
        for row in rank.rows:
            # The first bucket is handed over within a tiny backward; its all-reduce then waits 50 ms.
            assert row.ready_ms[0] < 25.0, row
            assert row.ms[0] >= 50.0, row
            assert row.ready_ms == sorted(row.ready_ms)  # handed over in order, each after the one before
    for r, rank in enumerate(comm.ranks):
        backward = {row.step: row.ms.backward for row in phases.ranks[r].rows}
        for row in rank.rows:  # backward waits for the last all-reduce: ready + exposed fit inside it
            assert max(row.ready_ms) + row.exposed_ms <= backward[row.step] + 1.0, row
