"""In-process CPU Trainers for the tests: the fast multi-process Trainer (ranks forked from the test process), a
profiled 2-rank run, and bitwise checkpoint comparison."""

import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lit_ddp.run.strategy import LitDDPStrategy
from tests.recorders import RecordDDPBuckets


def cpu_start_method() -> str:
    """How a test starts CPU ranks from this process: forked, as ``python -m lit_ddp.fit`` does on CPUs; spawned
    once this process has initialised CUDA (a GPU test before it), which a forked child cannot use."""
    return "spawn" if torch.cuda.is_initialized() else "fork"


def fast_trainer(root_dir: Path, devices=2, max_steps=5, callbacks=(), logger=False, enable_checkpointing=False,
                 max_epochs=None, spawn=True, **strategy_kwargs) -> Trainer:  # fmt: skip
    """CPU, ranks forked from this process (``ddp_fork``, what ``python -m lit_ddp.fit`` does on CPUs; a few
    tests spawn on purpose), a few steps, quiet, logger and checkpointing off unless asked; ``strategy_kwargs`` go
    to ``LitDDPStrategy``. ``spawn=False``: one rank in this process (Lightning's single-device strategy), whose
    logs ``caplog`` sees."""
    if spawn:
        strategy_kwargs.setdefault("timeout_s", 30)
        strategy_kwargs.setdefault("start_method", cpu_start_method())
        strategy = LitDDPStrategy(**strategy_kwargs)
    else:
        assert devices == 1 and not strategy_kwargs, "spawn=False runs one rank, with no DDP options"
        strategy = "auto"
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        logger=logger,
        enable_checkpointing=enable_checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root_dir,
    )


def assert_same_checkpoint(a: Path, b: Path, global_step: int) -> None:
    """Both checkpoints are at ``global_step`` and bitwise equal: every weight and Adam's whole state."""
    ca, cb = (torch.load(path, weights_only=True) for path in (a, b))
    assert ca["global_step"] == cb["global_step"] == global_step
    assert ca["state_dict"].keys() == cb["state_dict"].keys()
    for key, value in ca["state_dict"].items():
        assert torch.equal(value, cb["state_dict"][key]), key
    sa, sb = ca["optimizer_states"][0]["state"], cb["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys() and sa, "no Adam state to compare"
    for index in sa:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[index][key], sb[index][key]), f"optimizer state {index}.{key}"


def profile(make_trainer, tmp_path, dim, num_layers=1, compression=None, steps=4, **strategy_kwargs):
    """A 2-rank run with PhaseTimer and CommMonitor; returns its ``PhaseRecord`` and ``CommRecord``
    (as written to the log directory), DDP's own bucket sizes and the log directory."""
    from lit_ddp import FixedBatchDataModule, LinearRegression
    from lit_ddp.callbacks import CommMonitor, PhaseTimer
    from lit_ddp.records import schema as record

    log_dir = tmp_path / "run" / "version_0"
    trainer = make_trainer(
        max_steps=steps,
        callbacks=[PhaseTimer(), CommMonitor(compression=compression), RecordDDPBuckets(tmp_path / "ddp.json")],
        logger=CSVLogger(tmp_path, name="run", version=0),
        **strategy_kwargs,
    )
    trainer.fit(LinearRegression(dim=dim, num_layers=num_layers), FixedBatchDataModule(dim=dim, batch_size=8))
    phases, comm = record.load_run(log_dir)
    assert phases is not None and comm is not None, f"no phases.json or comm.json in {log_dir}"
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    return phases, comm, ddp, log_dir
