"""CommMonitor's timing of a real 2-rank run, where the all-reduce is made slow on purpose: each bucket's ready
time is its hand-over to the comm hook, not the end of its all-reduce."""

import torch
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
            # The first bucket's all-reduce waits 50 ms in the hook, and ready is its hand-over: were it the
            # all-reduce's end, it would come after the hand-over by the all-reduce's whole time, not before it.
            assert row.ms[0] >= 50.0, row
            assert row.ready_ms[0] < row.ms[0], row
            assert row.ready_ms == sorted(row.ready_ms)  # handed over in order, each after the one before
    for r, rank in enumerate(comm.ranks):
        backward = {row.step: row.ms.backward for row in phases.ranks[r].rows}
        for row in rank.rows:  # backward waits for the last all-reduce: ready + exposed fit inside it
            assert max(row.ready_ms) + row.exposed_ms <= backward[row.step] + 1.0, row


def _bucket(index, start, end, arrival=None, backward_start=0.0):
    from lit_ddp.callbacks.comm_monitor import BucketTiming

    return BucketTiming(1, index, 4, backward_start, start=start, arrival=arrival, end=end)


def test_on_nccl_a_bucket_transfer_starts_when_the_one_before_it_ended():
    """NCCL runs the buckets back to back on one stream: bucket 1, ready at 2 ms while bucket 0 ran until 10 ms,
    transfers from 10 ms to 15 ms (5 ms), not 13 ms; on gloo (worker threads, overlapping) from its hand-over."""
    buckets = [_bucket(0, 0.000, 0.010), _bucket(1, 0.002, 0.015), _bucket(2, 0.020, 0.021)]
    monitor = CommMonitor()
    assert [round(t, 6) for t in monitor._transfer_ms(buckets)] == [10.0, 13.0, 1.0]
    monitor._serial = True
    assert [round(t, 6) for t in monitor._transfer_ms(buckets)] == [10.0, 5.0, 1.0]


class FakeEvent:
    """A ``torch.cuda.Event`` on a made-up GPU timeline: ``record`` takes the GPU's time now."""

    gpu_now = 0.0

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self, stream=None):
        self.t = FakeEvent.gpu_now

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_on_cuda_a_bucket_arrives_when_the_gpu_had_its_gradients_not_when_the_host_queued_them(monkeypatch):
    """The host queues the backward far ahead of the GPU: the arrival is the hook's event, put on the host clock
    through the anchor (an event recorded on an idle GPU at a known host time)."""
    from types import SimpleNamespace

    from lit_ddp.measure import clock

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(clock, "host_now", lambda: 100.0)
    cuda = clock.CudaClock()
    FakeEvent.gpu_now = 5.0
    assert cuda.anchor() == 0.0  # host 100.0 is GPU 5.0
    FakeEvent.gpu_now = 5.250  # the GPU reaches the bucket's hand-over 250 ms later
    ready = cuda.mark()
    assert cuda.host_seconds(ready) == 100.25

    monitor = CommMonitor()
    monitor._clock = cuda
    FakeEvent.gpu_now = 5.300
    done = cuda.mark()
    row_of = {}
    monitor._window.add = lambda step, row: row_of.setdefault(step, row)
    trainer = SimpleNamespace(is_global_zero=False, callbacks=[])
    monitor._add(trainer, 1, [_bucket(0, ready, done, backward_start=None)])  # arrival None: not taken on the host
    assert row_of[1].arrival_s == [100.25]
    assert round(row_of[1].ms[0], 6) == 50.0
