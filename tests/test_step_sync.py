"""StepSync: at most one small collective per step, none when nothing needs it, and no barrier."""

import json

import pytest
import torch.distributed as dist
from lightning.pytorch import Callback

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import LossMonitor, StepSync, SyncCheck

COLLECTIVES = tuple(
    name
    for name in (
        "all_gather",
        "all_gather_single",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "barrier",
        "reduce",
    )
    if hasattr(dist, name)
)


def gathers_and_others(counts: dict[str, int]) -> tuple[int, dict[str, int]]:
    """The single-tensor all-gathers (under either of torch's names), and every other collective."""
    others = dict(counts)
    return others.pop("all_gather_single", 0) + others.pop("all_gather_into_tensor", 0), others


class CountCollectives(Callback):
    """Counts Python-level torch.distributed calls from the start of step 1 to the end of the epoch's last step,
    per rank. (DDP's own gradient all-reduce runs in its C++ reducer and is not counted; the epoch's end, where
    the module's torchmetrics metric is computed and synchronized once, is not a step.)"""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.counts = dict.fromkeys(COLLECTIVES, 0)
        self.counting = False

    def setup(self, trainer, pl_module, stage):
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                if self.counting:
                    self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counting = trainer.global_step >= 1  # step 0 has DDP's and the sync check's start-up work

    def on_train_epoch_end(self, trainer, pl_module):
        self.counting = False

    def on_train_end(self, trainer, pl_module):
        sync = next(c for c in trainer.callbacks if isinstance(c, StepSync))
        result = {"counts": self.counts, "steps": trainer.global_step - 1, "collectives": sync.collectives}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run(make_trainer, tmp_path, callbacks, steps=6):
    trainer = make_trainer(max_steps=steps, callbacks=[*callbacks, CountCollectives(tmp_path)])
    trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_loss_nan_check_and_sync_check_share_one_all_gather_per_step(make_trainer, tmp_path):
    ranks = run(make_trainer, tmp_path, [LossMonitor(every_n_steps=1), SyncCheck(every_n_steps=1)])
    for rank in ranks:
        assert rank["steps"] == 5  # counted steps 1..5
        gathers, others = gathers_and_others(rank["counts"])
        assert gathers == 5 and not any(others.values()), rank["counts"]
        assert rank["collectives"] == 6  # steps 0..5


def test_nothing_due_means_no_collective(make_trainer, tmp_path):
    quiet = [LossMonitor(every_n_steps=0, check_finite=False), SyncCheck(every_n_steps=0), StepSync(100)]
    ranks = run(make_trainer, tmp_path, quiet)
    for rank in ranks:
        # Only the sync check after the last step gathers; no SIGTERM check is due before step 100.
        gathers, others = gathers_and_others(rank["counts"])
        assert gathers == 1 and not any(others.values()), rank["counts"]


def test_bad_argument_is_refused():
    with pytest.raises(ValueError, match="sigterm_every_n_steps=0"):
        StepSync(sigterm_every_n_steps=0)


def test_a_step_sync_listed_first_still_serves_the_callbacks_after_it(make_trainer, caplog):
    """Its batch end must come after theirs (they put there): attach moves it right after its caller."""
    sync, monitor = StepSync(), LossMonitor()
    trainer = make_trainer(devices=1, max_steps=3, callbacks=[sync, monitor], spawn=False)
    with caplog.at_level("INFO"):
        trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4))
    steps = [message.split(",")[0] for message in caplog.messages if message.startswith("Step ")]
    assert steps == ["Step 0", "Step 1", "Step 2"], caplog.messages  # the last one too
    callbacks = trainer.callbacks
    assert callbacks.index(sync) == callbacks.index(monitor) + 1


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_launching_parent_learns_how_rank_0s_training_ended(start_method):
    """Under ddp_fork/ddp_spawn the parent's StepSync never trains: rank 0's ending rides back with Lightning's
    worker output, so a SIGTERM that reached a rank and not the parent still ends the run as one (exit 143)."""
    import pickle
    from types import SimpleNamespace

    from lightning.pytorch import Trainer

    from lit_ddp._lightning import CarryBackLauncher
    from lit_ddp.errors import Ending
    from lit_ddp.run.strategy import LitDDPStrategy

    strategy = LitDDPStrategy(start_method=start_method)
    Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    launcher = strategy.launcher
    assert isinstance(launcher, CarryBackLauncher), type(launcher)
    rank0, parent = StepSync(), StepSync()
    rank0.ending = Ending.SIGTERM
    extra = launcher.get_extra_results(SimpleNamespace(callbacks=[LossMonitor(), rank0], callback_metrics={}))
    extra = pickle.loads(pickle.dumps(extra))  # through the launcher's queue
    launched = SimpleNamespace(callbacks=[parent, LossMonitor()], callback_metrics={})
    launcher.update_main_process_results(launched, extra)
    assert StepSync.ending_of(launched) is Ending.SIGTERM, "the launching parent reports a finished run"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_under_fast_yaml_stops_every_rank_at_the_same_step(tmp_path):
    """``configs/fast.yaml`` puts no slot in most steps' row: a rank that saw SIGTERM must not gather alone (its
    all-gather would pair with the other rank's bucket all-reduce). The flag waits for the next gather every
    rank makes (at most ``sigterm_every_n_steps`` later), and every rank stops after that same step."""
    import torch

    from tests.runner import ROOT, run_fit

    result = run_fit("--config", str(ROOT / "configs" / "fast.yaml"), "--devices", "2", "--model.dim", "64",
                     "--trainer.max_steps", "50", "--trainer.logger", "false", "--checkpoint.every_n_steps", "1000000",
                     "--trainer.strategy.timeout_s", "10", "--trainer.callbacks+=tests.test_faults.SigtermOnRank",
                     cwd=tmp_path, timeout=90)  # fmt: skip
    files = [tmp_path / "steps" / f"rank{rank}" for rank in (0, 1)]
    steps = [int(f.read_text()) if f.is_file() else None for f in files]  # None: that rank's training never ended
    assert None not in steps and steps[0] == steps[1], (
        f"rank 0 stopped at step {steps[0]}, rank 1 at {steps[1]} (None: never), exit {result.returncode}: "
        f"{result.stderr[-2000:]}"
    )
    # SIGTERM at step 3's start; the next row every rank sends is step 9's (global_step 10 at its end), read at
    # the end of step 10.
    assert 3 < steps[0] <= 3 + 2 * StepSync().sigterm_every_n_steps, steps
    assert result.returncode == 143, (result.returncode, result.stderr[-2000:])
    assert "lit-ddp-fit: stopped by SIGTERM" in result.stderr, result.stderr[-2000:]
    checkpoint = torch.load(tmp_path / "runs" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == steps[0]
