"""LitDDPStrategy as a drop-in for Lightning's DDPStrategy: its arguments, what reaches DDP, the user's checkpoint
plugin, nothing left in os.environ, Slurm's settings checked at launch. (Lightning's own DDP tests, run against it:
``benchmarks/lightning_conformance.py``, docs/testing.md.)"""

import inspect
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.errors import ClusterSettingsError, UnusedParametersError, UsageError
from lit_ddp.run.checkpointing import AtomicCheckpointIO
from lit_ddp.run.lifecycle import LAUNCHER_PID_ENV
from lit_ddp.run.strategy import DEFAULT_TIMEOUT, LitDDPStrategy
from tests.trainers import cpu_start_method


def cpu_trainer(tmp_path, strategy, **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=tmp_path, **kwargs)  # fmt: skip


def test_it_takes_every_argument_ddpstrategy_takes_in_its_order():
    ours = list(inspect.signature(LitDDPStrategy).parameters.values())
    theirs = list(inspect.signature(DDPStrategy).parameters.values())
    assert [p.name for p in ours[: len(theirs) - 1]] == [p.name for p in theirs[:-1]]  # all but **kwargs, in order
    assert ours[-1].kind is inspect.Parameter.VAR_KEYWORD and theirs[-1].kind is inspect.Parameter.VAR_KEYWORD


def test_ddp_gets_only_the_options_given():
    assert LitDDPStrategy()._ddp_kwargs == {}
    assert LitDDPStrategy(find_unused_parameters=True)._ddp_kwargs == {"find_unused_parameters": True}
    strategy = LitDDPStrategy(static_graph=True, bucket_cap_mb=1, init_sync=False)
    assert strategy._ddp_kwargs == strategy.ddp_kwargs == {"static_graph": True, "bucket_cap_mb": 1, "init_sync": False}


def test_timeout_is_a_timedelta_and_timeout_s_the_command_lines_spelling():
    assert LitDDPStrategy()._timeout == DEFAULT_TIMEOUT == timedelta(seconds=60)
    assert LitDDPStrategy(timeout=timedelta(minutes=5)).timeout_s == 300.0
    assert LitDDPStrategy(timeout_s=7)._timeout == timedelta(seconds=7)
    assert LitDDPStrategy(timeout=None).timeout_s is None  # torch's default, as DDPStrategy(timeout=None)
    assert LitDDPStrategy(timeout=timedelta(seconds=5), timeout_s=5).timeout_s == 5.0  # the same, twice: fine
    with pytest.raises(ValueError, match=r"timeout_s=5\)`: two timeouts, give one"):
        LitDDPStrategy(timeout=timedelta(seconds=30), timeout_s=5)
    with pytest.raises(ValueError, match=r"`LitDDPStrategy\(timeout=datetime.timedelta\(0\)\)` must be > 0"):
        LitDDPStrategy(timeout=timedelta(0))


def test_construction_changes_nothing_in_the_environment(tmp_path):
    before = dict(os.environ)
    cpu_trainer(tmp_path, LitDDPStrategy(start_method=cpu_start_method()))
    assert dict(os.environ) == before


class ChecksTheRank(Callback):
    """In each rank: DDP was built from the strategy's ``_ddp_kwargs`` as they were when fit started, the rank knows
    its launcher's pid, and the checkpoint plugin is the one given; at the end, the rank writes its step count
    (under ``ddp_fork`` the test process sees none of the ranks' state)."""

    def __init__(self, bucket_bytes: int, launcher_pid: int, io: TorchCheckpointIO, out: Path) -> None:
        self.bucket_bytes, self.launcher_pid, self.io, self.out = bucket_bytes, launcher_pid, io, out

    def on_train_start(self, trainer, pl_module) -> None:
        assert trainer.strategy.model.bucket_bytes_cap == self.bucket_bytes, trainer.strategy.model.bucket_bytes_cap
        assert os.environ.get(LAUNCHER_PID_ENV) == str(self.launcher_pid)
        assert type(trainer.strategy.checkpoint_io) is type(self.io)

    def on_train_end(self, trainer, pl_module) -> None:
        (self.out / f"rank{trainer.global_rank}.steps").write_text(str(trainer.global_step))


def test_the_users_checkpoint_plugin_and_a_timedelta_timeout_build_and_fit(tmp_path):
    io = TorchCheckpointIO()
    strategy = LitDDPStrategy(timeout=timedelta(seconds=30), process_group_backend="gloo",
                              start_method=cpu_start_method())  # fmt: skip
    strategy._ddp_kwargs["bucket_cap_mb"] = 1  # Lightning's tests and users edit them: DDP is built from them
    trainer = cpu_trainer(tmp_path, strategy, plugins=[io],
                          callbacks=[ChecksTheRank(2**20, os.getpid(), io, tmp_path)])  # fmt: skip
    assert trainer.strategy.checkpoint_io is io
    before = dict(os.environ)
    trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))
    assert [(tmp_path / f"rank{r}.steps").read_text() for r in (0, 1)] == ["3", "3"]
    assert {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT",)} == {
        k: v for k, v in before.items() if k not in ("MASTER_PORT",)
    }, "the fit left something in os.environ"  # Lightning's launcher sets MASTER_PORT, as under DDPStrategy
    assert LAUNCHER_PID_ENV not in os.environ


def test_atomic_writes_are_the_default_only_when_no_plugin_is_given(tmp_path):
    assert type(cpu_trainer(tmp_path, LitDDPStrategy()).strategy.checkpoint_io) is AtomicCheckpointIO
    io = TorchCheckpointIO()
    assert cpu_trainer(tmp_path, LitDDPStrategy(checkpoint_io=io)).strategy.checkpoint_io is io


def test_slurm_settings_are_checked_at_launch_before_any_rank_trains(tmp_path, monkeypatch):
    for name, value in {"SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                        "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "job", "SLURM_NODELIST": "node0",
                        "SLURM_JOB_ID": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    trainer = cpu_trainer(tmp_path, LitDDPStrategy(), num_nodes=1)  # builds, as under DDPStrategy
    with pytest.raises(ClusterSettingsError, match=r"You set `devices=2` in Lightning, but the number of tasks per "
                       r"node configured in SLURM `--ntasks-per-node=1` does not match") as raised:  # fmt: skip
        trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, UsageError)  # Lightning's, and ours
    assert trainer.global_step == 0 and not torch.distributed.is_initialized()


def test_unused_parameters_are_a_runtime_error_as_ddps_own_error_is():
    assert issubclass(UnusedParametersError, RuntimeError) and issubclass(UnusedParametersError, UsageError)


def test_post_local_sgd_is_configured_as_in_lightning():
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd

    from lit_ddp import _lightning

    state = post_local_sgd.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=8)
    strategy = LitDDPStrategy(ddp_comm_state=state, ddp_comm_hook=post_local_sgd.post_localSGD_hook,
                              model_averaging_period=4)  # fmt: skip
    assert _lightning.configured_comm_hook(strategy) == (post_local_sgd.post_localSGD_hook, None, state)
    assert strategy._model_averaging_period == 4  # DDPStrategy.setup builds its PeriodicModelAverager from it
    with pytest.raises(ValueError, match=r"powersgd_rank=\.\.\.\)` is a communication hook: give no ddp_comm_hook"):
        LitDDPStrategy(powersgd_rank=1, ddp_comm_state=state)
