"""Gradient accumulation as users run it: ``--trainer.accumulate_grad_batches 4``. A step is an optimizer step
everywhere: one step line per optimizer step with the mean loss of its micro-batches, phases summed over them (a
patched clock checks the sums), the roofline counting the step's FLOPs, CommMonitor showing that only the last
micro-batch's backward all-reduces (DDP's no_sync before it), one sync check per step, and a forecast that
models it so. On the notes' fixed batch every micro-batch holds the same rows, so the losses are those of the
run without accumulation."""

import csv
from types import SimpleNamespace

import pytest
import torch

from lit_ddp import LinearRegression
from lit_ddp.callbacks import PhaseTimer
from lit_ddp.callbacks.end_of_fit import EndOfFit
from lit_ddp.present import forecast
from lit_ddp.records import schema as record
from lit_ddp.scaling import model
from lit_ddp.scaling.links import Link, Topology
from lit_ddp.scaling.model import Bucket, Measured
from tests.runner import run_fits, step_losses, step_numbers

DIM, BATCH, STEPS, MICRO = 32, 8, 4, 4
TIMED = ("--devices", "2", "--model.dim", str(DIM), "--data.batch_size", str(BATCH),
         "--trainer.max_steps", str(STEPS), "--trainer.callbacks+=lit_ddp.callbacks.PhaseTimer",
         "--trainer.callbacks+=lit_ddp.callbacks.CommMonitor")  # fmt: skip


def logged_losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 2-rank run without and with accumulation (each in its own directory), both at once."""
    cwds = {micro: tmp_path_factory.mktemp(f"micro{micro}") for micro in (1, MICRO)}
    results = run_fits(
        *[((*TIMED, "--trainer.accumulate_grad_batches", str(micro)), cwd) for micro, cwd in cwds.items()]
    )
    found = {}
    for (micro, cwd), result in zip(cwds.items(), results, strict=True):
        assert result.returncode == 0, result.stderr[-3000:]
        found[micro] = SimpleNamespace(result=result, dir=cwd / "runs" / "mini_train" / "version_0")
    return found


@pytest.mark.timeout(300)
def test_one_line_per_optimizer_step_with_the_losses_of_the_run_without_accumulation(runs):
    plain, accumulated = runs[1], runs[MICRO]
    out = accumulated.result.stdout
    assert step_numbers(out) == list(range(STEPS)), out  # not four lines per step, no "Step -1"
    assert step_losses(out) == step_losses(plain.result.stdout)
    # The mean over the step's micro-batches (Lightning hands over each loss divided by 4): to 1e-5 relative.
    assert logged_losses(accumulated.dir) == pytest.approx(logged_losses(plain.dir), rel=1e-5)
    assert out.count(f"weights in sync across 2 ranks after step {STEPS - 1}") == 1


@pytest.mark.timeout(300)
def test_phase_table_roofline_and_records_count_optimizer_steps(runs):
    plain, accumulated = runs[1], runs[MICRO]
    out = accumulated.result.stdout
    assert f"2 rank(s), {MICRO} micro-batches per optimizer step (each phase summed over them), step 0 = " \
           f"warm-up, then {STEPS - 1} steady step(s):" in out  # fmt: skip
    assert "micro-batches per optimizer step" not in plain.result.stdout
    phases, comm = record.load_run(accumulated.dir)
    for rank in phases.ranks:
        assert [row.step for row in rank.rows] == list(range(STEPS))
        assert {row.micro_batches for row in rank.rows} == {MICRO}
        for row in rank.rows:
            ms = row.ms
            assert 0 < ms.backward_last < ms.backward  # the last of four backwards
            assert ms.forward + ms.backward + ms.update + ms.data + ms.other == pytest.approx(ms.step, abs=1e-6)
    # The roofline counts the optimizer step's work: four micro-batches' FLOPs and rows.
    plain_phases, _ = record.load_run(plain.dir)
    roof, one = phases.roofline, plain_phases.roofline
    assert (roof.micro_batches, roof.rows_per_rank) == (MICRO, MICRO * BATCH)
    assert (roof.forward_flop, roof.backward_flop) == (MICRO * one.forward_flop, MICRO * one.backward_flop)
    assert one.forward_flop == 2 * BATCH * DIM * DIM  # one Linear's matmul
    assert f"Roofline (rank 0, steady median; a step's work: {MICRO} micro-batches):" in out
    # Only the last micro-batch's backward all-reduced; the bytes are one all-reduce's.
    for rank in comm.ranks:
        assert {(row.micro_batches, tuple(row.synced)) for row in rank.rows} == {(MICRO, (MICRO - 1,))}
    assert sum(comm.layout) == (DIM * DIM + DIM) * 4
    assert (f"gradient accumulation: {MICRO} micro-batches per step; only the last one's backward all-reduced "
            f"(micro-batch {MICRO - 1}), the other {MICRO - 1} ran under DDP's no_sync") in out  # fmt: skip


@pytest.mark.timeout(300)
def test_forecast_of_an_accumulated_run(runs):
    run = model.measured_run(runs[MICRO].dir)
    assert run.micro_batches == MICRO and run.rows_per_rank == MICRO * BATCH
    assert 0 < run.backward_before_ms < run.backward_ms
    text = forecast.report(run, Topology(SLOW, SLOW, 8), [1, 8], [], "test")
    assert f"gradient accumulation: {MICRO} micro-batches per step, all-reduced once" in text


SLOW = Link("slow", busbw_gbps=1.0, hop_latency_us=0.0, source="test")


def test_forecast_model_keeps_the_earlier_backwards_out_of_the_overlap():
    """Three earlier backwards of 10 ms (under no_sync) are compute: they add to the step at every N and hide
    no communication; the bucket is ready 10 ms into the last backward."""
    run = Measured(forward_ms=4.0, update_ms=2.0, other_ms=1.0, tail_ms=0.0, buckets=(Bucket(1e6, 10.0),),
                   world_size=2, rows_per_rank=32, compression=None, backward_ms=40.0, exposed_ms=1.0, comm_ms=1.0,
                   step_ms=48.0, n_steps=3, backward_before_ms=30.0, micro_batches=4)  # fmt: skip
    one, two = (model.simulate(run, n, Topology(SLOW, SLOW, 8)) for n in (1, 2))
    assert one.step_ms == pytest.approx(4 + 30 + 10 + 2 + 1)
    assert two.exposed_ms == pytest.approx(1.0)  # 2(1)/2 x 1e6 B at 1 GB/s, after the last backward
    assert two.step_ms == pytest.approx(one.step_ms + 1.0)


class FakeTrainer(SimpleNamespace):
    """What PhaseTimer touches, one rank, ``accumulate_grad_batches`` micro-batches per step."""

    def __init__(self, model, log_dir, micro):
        strategy = SimpleNamespace(root_device=torch.device("cpu"), model=model)
        super().__init__(strategy=strategy, is_global_zero=True, global_rank=0, world_size=1, loggers=[],
                         global_step=0, log_dir=str(log_dir), callbacks=[], progress_bar_callback=None,
                         precision="32-true", optimizers=[torch.optim.Adam(model.parameters())],
                         accumulate_grad_batches=micro, profiler=None, sanity_checking=False,
                         log_every_n_steps=50, node_rank=0)  # fmt: skip

    def train_end(self, model, *callbacks):
        """Lightning's ``on_train_end``: ``callbacks``' first, then the ``EndOfFit`` they added (it saves)."""
        for callback in [*callbacks, *(c for c in self.callbacks if isinstance(c, EndOfFit))]:
            callback.on_train_end(self, model)


def test_phases_are_summed_over_the_micro_batches(monkeypatch, tmp_path):
    """Lightning's hook order for 3 micro-batches per step on a patched clock: zero_grad in the first, the
    update in the last; each micro-batch's forward 10 ms, backward 20 ms, 4 ms from its end to the next start."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("lit_ddp.measure.clock.perf_counter", lambda: clock.now)
    model, micro = LinearRegression(dim=8), 3
    trainer = FakeTrainer(model, tmp_path, micro)
    timer, opt = PhaseTimer(print_steps=0), trainer.optimizers[0]
    batch = (torch.zeros(4, 8), torch.zeros(4, 8))
    timer.on_train_start(trainer, model)
    for _ in range(3):
        for i in range(micro):
            timer.on_train_batch_start(trainer, model, batch, i)
            t0 = clock.now
            timer._on_forward_start(model, (batch,))
            clock.now = t0 + 0.010
            if i == 0:
                timer.on_before_zero_grad(trainer, model, opt)
            timer.on_before_backward(trainer, model, torch.tensor(1.0))
            clock.now = t0 + 0.030
            timer.on_after_backward(trainer, model)
            if i == micro - 1:
                timer.on_before_optimizer_step(trainer, model, opt)
                clock.now = t0 + 0.035  # update: 5 ms
                timer._on_optimizer_step_end(opt, (), {})
                trainer.global_step += 1
            clock.now += 0.001  # 1 ms to the batch end -> other
            timer.on_train_batch_end(trainer, model, {"loss": torch.tensor(1.0)}, batch, i)
            clock.now += 0.004  # -> data
    trainer.train_end(model, timer)
    phases = record.load(tmp_path / "phases.json")
    assert phases.steps == [0, 1, 2]
    for row in phases.ranks[0].rows:
        ms = row.ms
        assert row.micro_batches == micro
        assert (ms.forward, ms.backward, ms.update, ms.backward_last) == pytest.approx((30.0, 60.0, 5.0, 20.0))
        assert (ms.data, ms.other) == pytest.approx((12.0, 3.0))
        assert ms.step == pytest.approx(3 * 35.0 + 5.0)
        # Where the boundaries fell: the last micro-batch's forward and backward (the one that all-reduces).
        assert list(row.offsets_ms.values()) == pytest.approx([70.0, 80.0, 80.0, 100.0, 100.0, 105.0, 106.0, 110.0])
    assert phases.roofline.micro_batches == micro and phases.roofline.rows_per_rank == micro * 4


def test_checkpoints_are_written_after_optimizer_steps_only(tmp_path, monkeypatch, capsys):
    """A micro-batch's accumulated gradients are in no checkpoint: LastCheckpoint saves after optimizer steps."""
    from lit_ddp.run.checkpointing import AtomicCheckpointIO
    from tests.runner import run_main

    saved = []
    original = AtomicCheckpointIO.save_checkpoint

    def counting(self, checkpoint, path, storage_options=None):
        saved.append(checkpoint["global_step"])
        original(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counting)
    monkeypatch.chdir(tmp_path)
    result = run_main(monkeypatch, capsys, "--trainer.accelerator", "cpu", "--devices", "1", "--model.dim", "8",
                      "--trainer.max_steps", "4", "--trainer.accumulate_grad_batches", "3",
                      "--checkpoint.every_n_steps", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert saved == [2, 4]
    assert step_numbers(result.stdout) == [0, 1, 2, 3]


class RecordingSync:
    """StepSync's ``put`` and ``reserve`` as LossMonitor and SyncCheck call them: what each batch end put in."""

    def __init__(self):
        self.puts = []

    def put(self, key, values, on_result):
        self.puts.append((key, values.detach().clone()))

    def reserve(self, key, width, on_result):
        columns = torch.zeros(width, dtype=torch.float64)  # filled by the caller
        self.puts.append((key, columns))
        return columns


@pytest.mark.parametrize("kind", ["loss", "sync_check"])
def test_micro_batches_put_nothing_and_the_step_puts_its_mean_loss(kind):
    """Micro-batches of different losses (a real run's fixed batch cannot tell a mean from the last one): the step
    puts the mean of the unscaled losses, once; SyncCheck fingerprints the weights once per optimizer step."""
    from lit_ddp.callbacks import LossMonitor, SyncCheck

    model = LinearRegression(dim=4)
    trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=3, world_size=2, max_steps=10, max_epochs=None)
    callback = LossMonitor(every_n_steps=1) if kind == "loss" else SyncCheck()
    callback._sync = RecordingSync()
    for i, loss in enumerate((1.0, 2.0, 6.0)):  # Lightning hands over loss / accumulate_grad_batches
        callback.on_train_batch_start(trainer, model, None, i)
        if i == 2:
            trainer.global_step += 1
        callback.on_train_batch_end(trainer, model, {"loss": torch.tensor(loss / 3)}, None, i)
    ((key, row),) = callback._sync.puts
    assert key == kind
    if kind == "loss":
        assert row.tolist() == pytest.approx([3.0])  # mean 3 (the NaN check reads it; no grad scaler, no skip flag)
