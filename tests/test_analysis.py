"""The tables' numbers, on hand-made records, and the callbacks outside fit."""

import random
import re

import torch
from lightning.pytorch import LightningModule, Trainer

from lit_ddp import report
from lit_ddp.analysis.comm import comm_table
from lit_ddp.analysis.phases import MEASURE, verdict
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, StepSync, SyncCheck
from lit_ddp.records.schema import CommRecord, RankComm, RunMeta, StepBuckets, load_run, save
from lit_ddp.scaling.advice import wire_savings
from tests import records
from tests.records import phase_record
from tests.runner import ROOT


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


# The verdict (lit_ddp.analysis.phases.verdict) on hand-made records: a part of the step is named only beyond the
# noise model's interval (lit_ddp.analysis.noise), the all-reduce from CommMonitor's exposed time.


def noisy_steps(rng: random.Random, n: int, means: tuple[float, float, float, float], sd: float = 0.3):
    """``n`` steps of (forward, backward, update, other), each phase its mean plus seeded Gaussian noise."""
    return [tuple(max(0.01, rng.gauss(m, sd)) for m in means) for _ in range(n)]


def test_the_verdict_names_a_phase_beyond_the_noise_and_else_says_it_cannot_tell():
    rng = random.Random(0)
    clear = phase_record([noisy_steps(rng, 40, (1.0, 6.0, 1.0, 0.5))])
    line = verdict(clear)
    assert re.search(r"backward bounds the step, 6\.\d\d ms \(7\d%\): the model's compute, [45]\.\d\d ms per step "
                     r"\(.* to .*, 95%, 39 steps\) over (forward|update) \(", line), line  # fmt: skip
    assert line.endswith(MEASURE)
    level = phase_record([noisy_steps(rng, 40, (4.0, 4.1, 1.0, 0.5), sd=1.0)])
    line = verdict(level)
    assert re.search(r"can't tell what bounds the step, because (forward|backward) \([34]\.\d\d ms, [34]\d%\) and "
                     r"(forward|backward) \([34]\.\d\d ms, [34]\d%\), the largest parts, differ by .* per step "
                     r"\(.*, 95%, 39 steps\): within the noise; ", line), line  # fmt: skip
    # Beyond the noise but by little: a lead of 0.4 ms in a 9.6 ms step (4%) bounds nothing.
    close = phase_record([noisy_steps(rng, 40, (4.0, 4.4, 1.0, 0.2), sd=0.05)])
    assert "the largest parts, differ by 0.4" in verdict(
        close
    ) and ": not beyond the noise above 10% of the step; " in verdict(close)
    two_ranks = phase_record([noisy_steps(rng, 40, (1.0, 6.0, 1.0, 0.5))] * 2)  # no CommMonitor record to split it
    assert "backward bounds the step, " in verdict(two_ranks)
    assert "the model's compute, and the gradient all-reduce where backward does not hide it" in verdict(two_ranks)
    few = phase_record([noisy_steps(rng, 4, (1.0, 6.0, 1.0, 0.5))])
    assert "can't tell what bounds the step, because only 3 steady step(s) were kept" in verdict(few)


def comm_bound_case(steps: int = 30, seed: int = 0) -> tuple:
    """The issue's measured case: 2 nodes over a 100 Mbit/s link, dim 1024 (4,198,400 bytes in one bucket): the
    all-reduce takes ~336 ms of a ~352 ms step, forward ~3 ms; both ranks hand the bucket over together."""
    rng = random.Random(seed)
    rows, buckets = [[], []], [[], []]
    for s in range(steps):
        transfer = rng.gauss(336.0, 4.0)
        for r in range(2):
            forward, compute, update, other = (rng.gauss(m, 0.3) for m in (3.0, 6.0, 5.0, 2.0))
            rows[r].append((forward, compute + transfer, update, other))
            arrival = (400.0 * s + forward + compute + rng.gauss(0.0, 0.2)) / 1e3
            buckets[r].append(StepBuckets(s, [4_198_400], [transfer], [compute], transfer, transfer, [arrival]))
    return phase_record(rows), records.comm_record(buckets, param_bytes=4_198_400)


def test_a_communication_bound_step_is_called_so_with_the_figure_of_the_change_that_cuts_the_bytes(tmp_path):
    phases, comm = comm_bound_case()
    line = verdict(phases, comm)
    assert re.search(r"communication-bound: the gradient all-reduce's exposed transfer is 33\d\.\d\d ms of the "
                     r"35\d\.\d\d ms step \(9\d%\)", line), line  # fmt: skip
    assert "backward bounds" not in line and "straggler" not in line
    # The figure: the forecast's model at 2 ranks over the link these all-reduces ran at (lit_ddp.scaling.advice).
    run_dir = tmp_path / "run"
    save(phases, run_dir / "phases.json"), save(comm, run_dir / "comm.json")
    savings = wire_savings(run_dir, comm)
    (label, saving), = savings.items()  # fmt: skip
    assert label.startswith("fp16 compression") and 160 < saving < 175  # half the bytes: half the 336 ms
    line = verdict(phases, comm, savings)
    assert re.search(r"fp16 compression \(.*\): step 35\d\.\d\d ms -> ~1[89]\d\.\d\d ms, forecast$", line), line
    assert wire_savings(run_dir, None) == {} and wire_savings(None, comm) == {}
    # Without CommMonitor's record the same steps are backward's: the model's compute and the all-reduce's.
    assert "backward bounds the step" in verdict(phases)


def test_the_measured_two_node_run_is_communication_bound_with_the_fp16_figure(capsys):
    """The record of a real run over a 100 Mbit/s link (tests/data/two_nodes_100mbit): the all-reduce's exposed
    transfer, 377 ms of a 746 ms step, is what bounds it, and halving the bytes is forecast to save ~190 ms."""
    run_dir = ROOT / "tests" / "data" / "two_nodes_100mbit"
    phases, comm = load_run(run_dir)
    (saving,) = wire_savings(run_dir, comm).values()
    assert 150 < saving < 230  # about half the transfer: the rest of the step is compute
    line = verdict(phases, comm, {"fp16 compression": saving})
    assert re.search(r"communication-bound: the gradient all-reduce's exposed transfer is 377\.17 ms of the "
                     r"746\.24 ms step \(51%\), .*; fp16 compression: step 746\.24 ms -> ~5\d\d\.\d\d ms, forecast$",
                     line), line  # fmt: skip
    assert report.main([str(run_dir), "--no-plot"]) == 0
    assert (
        "fp16 compression (CommMonitor(compression=fp16): half the bytes): step 746.24 ms -> ~"
        in capsys.readouterr().out
    )
