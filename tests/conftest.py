"""Shared fixtures: the fast CPU trainer factory, and clean-up that keeps tests independent."""

import functools
import logging
import os

import pytest
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from tests.trainers import fast_trainer

# Loggers that `lit_ddp.run.console.setup` (run by an in-process `main()`) points at the stdout of its time, a
# capsys buffer that is closed after its test.
_CONFIGURED_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lit_ddp", "torch.multiprocessing.spawn")


@pytest.fixture(autouse=True)
def _restore_env_and_process_group():
    """Lightning's launchers write MASTER_ADDR/PORT, WORLD_SIZE, LOCAL_RANK... into os.environ, and a Trainer
    built as some rank (a simulated Slurm rank 3) sets the rank that rank_zero_info obeys in this process;
    undo both."""
    env = dict(os.environ)
    ranks = rank_zero_only.rank, utils_rank_zero_only.rank
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    rank_zero_only.rank, utils_rank_zero_only.rank = ranks


@pytest.fixture(autouse=True)
def _restore_logging():
    saved = {}
    for name in _CONFIGURED_LOGGERS:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(devices=2, max_steps=5, callbacks=[...], **strategy_kwargs)``: ``fast_trainer`` in
    ``tmp_path``."""
    return functools.partial(fast_trainer, tmp_path)
