"""The tables' numbers, on hand-made records, and the callbacks outside fit."""

import re

import torch
from lightning.pytorch import LightningModule, Trainer

from lit_ddp.analysis.comm import comm_table
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, StepSync, SyncCheck
from lit_ddp.records.schema import CommRecord, RankComm, RunMeta, StepBuckets


def comm_record(world_size: int, nbytes: int, ms: list[float]) -> CommRecord:
    """One bucket of ``nbytes``; every rank hands it over at the same moment, rank r's all-reduce takes ms[r]."""
    meta = RunMeta(world_size, "cpu", "cpu", "gloo", "perf_counter", "32-true", "2", "2")
    ranks = [RankComm(r, [StepBuckets(s, [nbytes], [ms[r]], [1.0], ms[r], ms[r], [float(s)]) for s in range(6)], {})
             for r in range(world_size)]  # fmt: skip
    return CommRecord(meta, ranks, [nbytes], nbytes, clock_offset_s=[0.0] * world_size,
                      clock_error_s=[0.0] * world_size)  # fmt: skip


def test_bandwidth_follows_the_nccl_tests_definitions():
    # 8 MB in 4 ms (the shortest duration across ranks: the transfer): algbw 2 GB/s; busbw = algbw x 2(n-1)/n.
    text = comm_table(comm_record(4, 8_000_000, [4.0, 5.0, 4.5, 6.0]))
    assert re.search(r"^0\s+8,000,000\s+4\.00 ms\s+2\.00 GB/s\s+3\.00 GB/s\s+0\.00 ms$", text, re.M), text
    assert "each rank sends 2(n-1)/n x S = 12,000,000 bytes in a ring all-reduce" in text


def test_two_ranks_busbw_equals_algbw():
    text = comm_table(comm_record(2, 1_000_000, [1.0, 1.0]))
    assert re.search(r"^0\s+1,000,000\s+1\.00 ms\s+1\.00 GB/s\s+1\.00 GB/s", text, re.M), text
    # A small bucket on a slow link: its unit by magnitude (82,000 bytes in 4 ms), not 0.02 GB/s.
    text = comm_table(comm_record(2, 82_000, [4.0, 4.0]))
    assert re.search(r"^0\s+82,000\s+4\.00 ms\s+20\.5 MB/s\s+20\.5 MB/s", text, re.M), text


class WithValidation(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def validation_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 4)), batch_size=2)


def test_outside_fit_the_callbacks_stand_aside(tmp_path):
    # validate on one CPU device: CommMonitor would refuse a non-DDP strategy in fit, and no StepSync is added.
    callbacks = [LossMonitor(), SyncCheck(), CommMonitor(), PhaseTimer()]
    trainer = Trainer(accelerator="cpu", devices=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.validate(WithValidation())
    assert not any(isinstance(c, StepSync) for c in trainer.callbacks)
