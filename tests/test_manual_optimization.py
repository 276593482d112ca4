"""Manual optimization (``automatic_optimization = False``, ``manual_backward``, ``optimizer.step()``) in a user's
Trainer on 2 CPU ranks (Lightning's own DDP strategy): every phase timed as in automatic optimization, the
roofline's FLOPs counted in the real first step, as in automatic optimization (the losses show that counting
trained nothing), the all-reduce, the sync check and one line per optimizer step. With the step taken
every second batch, both batches are micro-batches of one step, and CommMonitor shows that each backward
all-reduced (manual optimization has no no_sync unless the step asks for it)."""

import re

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, SyncCheck
from lit_ddp.records import schema as record
from tests.recorders import RecordLogs
from tests.runner import step_losses, step_numbers
from tests.trainers import cpu_start_method, fast_trainer


class Manual(LinearRegression):
    def __init__(self, every=1, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.every = every

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        self.manual_backward(loss / self.every)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            opt.zero_grad()
        return loss


def run(tmp_path, mode, every=1):
    """A user's Trainer (Lightning's own DDP strategy, 2 CPU ranks forked from this process), 4 steps of the manual
    module or of the notes' (``mode="auto"``); what rank 0 printed, and the run's records."""
    seed_everything(0)
    model = Manual(every=every, dim=32) if mode == "manual" else LinearRegression(dim=32)
    logs = tmp_path / f"{mode}_logs"
    logs.mkdir()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(start_method=cpu_start_method()), max_steps=4,
                      logger=CSVLogger(tmp_path / "out", name=mode, version=0), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[PhaseTimer(), CommMonitor(), SyncCheck(), LossMonitor(every_n_steps=1),
                                 RecordLogs(logs)])  # fmt: skip
    trainer.fit(model, FixedBatchDataModule(dim=32, batch_size=8))
    out = RecordLogs.read(logs, 0)
    assert "counting FLOPs failed" not in out, out[-3000:]
    return out, record.load_run(tmp_path / "out" / mode / "version_0")


def check_phases(phases, micro):
    for rank in phases.ranks:
        assert [row.step for row in rank.rows] == [0, 1, 2, 3]
        for row in rank.rows:
            ms = row.ms
            assert row.micro_batches == micro
            assert min(ms.forward, ms.backward, ms.update, ms.data, ms.step) > 0, ms
            assert ms.forward + ms.backward + ms.update + ms.data + ms.other == pytest.approx(ms.step, abs=1e-6)


@pytest.mark.slow
def test_manual_optimization_is_timed_as_automatic(tmp_path):
    out, (phases, comm) = run(tmp_path, "manual")
    auto_out, (auto_phases, _) = run(tmp_path, "auto")
    check_phases(phases, micro=1)
    # The FLOPs of the real step equal automatic optimization's, and counting them did not train: the same losses,
    # step for step.
    for field in ("forward_flop", "backward_flop", "rows_per_rank", "update_bytes"):
        assert getattr(phases.roofline, field) == getattr(auto_phases.roofline, field), field
    assert phases.roofline.forward_flop == 2 * 8 * 32 * 32
    assert step_numbers(out) == [0, 1, 2, 3]
    assert step_losses(out) == step_losses(auto_out)
    assert re.search(r"^forward\s+16.4 kFLOP", out, re.M), out[-2000:]
    assert {tuple(row.synced) for rank in comm.ranks for row in rank.rows} == {(0,)}
    assert out.count("weights in sync across 2 ranks after step 3") == 1


def test_manual_accumulation_over_two_batches(tmp_path):
    out, (phases, comm) = run(tmp_path, "manual", every=2)
    check_phases(phases, micro=2)
    assert step_numbers(out) == [0, 1, 2, 3]
    assert phases.roofline.rows_per_rank == 16 and phases.roofline.forward_flop == 2 * 2 * 8 * 32 * 32
    assert {(row.micro_batches, tuple(row.synced)) for rank in comm.ranks for row in rank.rows} == {(2, (0, 1))}
    assert "gradient accumulation: 2 micro-batches per step, and micro-batches [0, 1] all-reduced: 2x the bytes" in out


def test_a_second_fit_with_the_same_timer_counts_its_own_flops(tmp_path):
    """Each fit's state is made fresh: a second manual-optimization fit with the same PhaseTimer counts the same
    FLOPs as the first (its backward's are not taken off the earlier fit's), and warms up at its own first step."""
    timer = PhaseTimer()
    rooflines = []
    for run in ("first", "second"):
        trainer = fast_trainer(tmp_path / run, devices=1, max_steps=3, callbacks=[timer], spawn=False,
                               logger=CSVLogger(tmp_path, name=run, version=0))  # fmt: skip
        trainer.fit(Manual(dim=32), FixedBatchDataModule(dim=32, batch_size=8))
        rooflines.append(timer.record.roofline)
        assert timer.record.first_step == 0 and timer.record.steps == [0, 1, 2]
    assert rooflines[0] == rooflines[1]
    assert (rooflines[1].forward_flop, rooflines[1].backward_flop) == (2 * 8 * 32 * 32, 2 * 8 * 32 * 32)
