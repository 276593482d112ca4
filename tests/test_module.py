import csv
import json

import pytest
import torch
from lightning.pytorch import Callback
from torch.nn.parallel import DistributedDataParallel

from lit_ddp import FixedBatchDataModule, LinearRegression
from tests.runner import step_losses


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dim": 0}, "dim=0"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"num_layers": 0}, "num_layers=0"),
        ({"betas": (0.9, 1.5)}, "betas"),
        ({"foreach": True, "fused": True}, "choose one"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinearRegression(**kwargs)


def test_loss_is_the_notes_mse():
    model = LinearRegression(dim=8)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(model.training_step((x, y), 0), ((model.net(x) - y) ** 2).mean())


def test_optimizer_settings_reach_adam():
    opt = LinearRegression(dim=8, lr=0.5, betas=(0.8, 0.9), foreach=False).configure_optimizers()
    assert isinstance(opt, torch.optim.Adam)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["foreach"]) == (0.5, (0.8, 0.9), False)


def test_num_layers_stacks_linears():
    model = LinearRegression(dim=8, num_layers=3)
    assert [type(m).__name__ for m in model.net] == ["Linear"] * 3


class OptimizerHoldsWrappedParams(Callback):
    """Writes, per rank, whether the optimizer's tensors *are* the DDP-wrapped module's parameters."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_start(self, trainer, pl_module):
        wrapped = trainer.strategy.model
        opt_params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
        ddp_params = list(wrapped.module.parameters())
        result = {
            "is_ddp": isinstance(wrapped, DistributedDataParallel),
            "same_count": len(opt_params) == len(ddp_params),
            "identical": all(a is b for a, b in zip(opt_params, ddp_params, strict=False)),
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def test_optimizer_is_created_after_ddp_wrapping(make_trainer, tmp_path):
    """The notes' pitfall cannot happen: Lightning calls configure_optimizers after wrapping in DDP."""
    trainer = make_trainer(max_steps=1, callbacks=[OptimizerHoldsWrappedParams(tmp_path)])
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "is_ddp": True,
            "same_count": True,
            "identical": True,
        }


def test_the_epochs_mse_is_the_mean_of_the_printed_global_losses(notes_run):
    # torchmetrics syncs across ranks once, at the epoch's end: every element of every rank's rows of the epoch.
    result = notes_run.result
    assert result.returncode == 0, result.stderr
    with open(notes_run.cwd / "runs" / "mini_train" / "version_0" / "metrics.csv", newline="") as f:
        (mse,) = [float(row["train/mse"]) for row in csv.DictReader(f) if row.get("train/mse")]
    losses = step_losses(result.stdout)
    assert len(losses) == 5
    assert mse == pytest.approx(sum(losses) / len(losses), rel=1e-4)
