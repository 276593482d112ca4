"""A user's module with a layer that never takes part in the loss, under DDP with and without
``find_unused_parameters``."""

import re

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.multiprocessing import ProcessRaisedException

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.analysis.run_analysis import analyze
from lit_ddp.callbacks import CommMonitor
from lit_ddp.measure.gradients import LIGHTNING_UNUSED, name_unused
from lit_ddp.present.comm import comm_table
from lit_ddp.records.schema import load_run
from lit_ddp.run.lifecycle import exit_code
from tests.trainers import cpu_start_method


class WithUnusedLayer(LinearRegression):
    """The notes' model and a second Linear that forward never calls."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__(dim=dim)
        self.unused = nn.Linear(dim, dim)


def user_trainer(tmp_path, strategy) -> Trainer:
    """A plain Lightning Trainer as in a user's script, Lightning's own DDP strategy, 2 CPU ranks (forked from this
    process: ``ddp_fork``)."""
    return Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, callbacks=[CommMonitor()],
                   logger=CSVLogger(tmp_path, name="run", version=0), enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)  # fmt: skip


def test_with_find_unused_parameters_the_table_says_what_got_no_gradient(tmp_path):
    strategy = DDPStrategy(find_unused_parameters=True, start_method=cpu_start_method())
    user_trainer(tmp_path, strategy).fit(WithUnusedLayer(), FixedBatchDataModule(dim=16, batch_size=4))
    _, comm = load_run(tmp_path / "run" / "version_0")
    assert comm.find_unused_parameters and comm.unused_every_step
    assert comm.unused == ["unused.weight", "unused.bias"]
    assert comm.unused_bytes == 4 * (16 * 16 + 16) == comm.param_bytes // 2
    text = comm_table(analyze(None, comm))
    assert ("find_unused_parameters=True: 2 parameter(s), 1,088 bytes (50% of the gradients), got no gradient in "
            "every step: unused.weight, unused.bias") in text  # fmt: skip
    assert "static_graph=True, since the same ones are unused every step" in text


def test_without_it_every_rank_stops_after_the_first_backward_naming_them(tmp_path):
    strategy = DDPStrategy(start_method=cpu_start_method())
    with pytest.raises(ProcessRaisedException) as raised:
        user_trainer(tmp_path, strategy).fit(WithUnusedLayer(), FixedBatchDataModule(dim=16, batch_size=4))
    last = raised.value.msg.strip().splitlines()[-1]
    assert last.startswith("lit_ddp.errors.UnusedParametersError: It looks like your LightningModule has parameters "
                           "that were not used in producing the loss returned by training_step: "
                           "2 parameter(s) got no gradient in step 0: "
                           "unused.weight, unused.bias;"), last  # fmt: skip
    assert "every step: DDPStrategy(find_unused_parameters=True) (static_graph" in last  # a script's phrasing
    # From the CLI that is bad input: one line, exit 2.
    assert exit_code(lambda: (_ for _ in ()).throw(raised.value)) == 2


def test_the_cli_strategy_checks_too(make_trainer):
    with pytest.raises(Exception, match=re.escape("2 parameter(s) got no gradient in step 0: unused.weight")):
        make_trainer(max_steps=2).fit(WithUnusedLayer(), FixedBatchDataModule(dim=16, batch_size=4))


def test_a_model_whose_parameters_all_take_part_passes(make_trainer):
    model = LinearRegression(dim=16)
    make_trainer(max_steps=2, callbacks=[CommMonitor()]).fit(model, FixedBatchDataModule(dim=16, batch_size=4))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("words", [
    "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates ...",
    f"{LIGHTNING_UNUSED}, you must enable the detection of unused parameters in DDP, ...",  # Lightning's, in place
])  # fmt: skip
def test_a_parameter_left_out_after_the_first_step_is_named_by_ddps_error_at_the_next_forward(words):
    """A branch one rank takes at step 2 only: DDP (or Lightning, in its words) fails at step 3's forward without a
    name; the gradients are still step 2's (Lightning zeroes them after training_step), so the error is made to
    name the rank and the parameters."""
    model = WithUnusedLayer(dim=4)
    for name, p in model.named_parameters():
        if not name.startswith("unused."):
            p.grad = torch.zeros_like(p)
    error = RuntimeError(words)
    name_unused(error, model, step=3, rank=1)
    assert str(error).startswith("It looks like your LightningModule has parameters that were not used in producing "
                                 "the loss returned by training_step: 2 parameter(s) got no gradient in step 2 on "
                                 "rank 1: unused.weight, unused.bias; DDP would wait")  # fmt: skip
    again = str(error)
    name_unused(error, model, step=3, rank=1)
    assert str(error) == again  # named once
    other = RuntimeError("Connection closed by peer")
    name_unused(other, model, step=3, rank=1)
    assert str(other) == "Connection closed by peer"
    model.unused.weight.grad = torch.zeros_like(model.unused.weight)
    model.unused.bias.grad = torch.zeros_like(model.unused.bias)
    untouched = RuntimeError(words)
    name_unused(untouched, model, step=3, rank=1)  # every parameter got one: DDP's words stay
    assert str(untouched) == words
