"""Shared fixtures: a fast CPU ``ddp_spawn`` trainer factory and clean-up that keeps tests independent."""

import os

import pytest
import torch.distributed as dist
from lightning.pytorch import Trainer

from lit_ddp.strategy import LitDDPStrategy


@pytest.fixture(autouse=True)
def _restore_env_and_process_group():
    """Lightning's launchers write MASTER_ADDR/PORT, WORLD_SIZE, LOCAL_RANK... into os.environ; undo it."""
    env = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(devices=2, max_steps=5, callbacks=[...], **strategy_kwargs)``: CPU, ``ddp_spawn``, quiet."""

    def make(devices=2, max_steps=5, callbacks=(), logger=False, enable_checkpointing=False, **strategy_kwargs):
        strategy_kwargs.setdefault("timeout_s", 30)
        return Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=LitDDPStrategy(start_method="spawn", **strategy_kwargs),
            max_steps=max_steps,
            callbacks=list(callbacks),
            logger=logger,
            enable_checkpointing=enable_checkpointing,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )

    return make
