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
    """The single-tensor all-gathers (under either of torch's names, or StepSync's start of one), and every other
    collective."""
    others = dict(counts)
    names = ("all_gather_single", "all_gather_into_tensor", "all_gather_started")
    return sum(others.pop(name, 0) for name in names), others


class CountCollectives(Callback):
    """Counts Python-level torch.distributed calls from the start of step 1 to the end of the epoch's last step,
    per rank. (DDP's own gradient all-reduce runs in its C++ reducer and is not counted; the epoch's end, where
    the module's torchmetrics metric is computed and synchronized once, is not a step.)"""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.counts = dict.fromkeys(COLLECTIVES, 0)
        self.counting = False

    def setup(self, trainer, pl_module, stage):
        from lit_ddp import _torch

        self.counts["all_gather_started"] = 0
        for module, name in [*((dist, name) for name in COLLECTIVES), (_torch, "all_gather_started")]:
            original = getattr(module, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                if self.counting:
                    self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(module, name, counted)

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
    sync, monitor = StepSync(), LossMonitor(every_n_steps=1)
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

    from lit_ddp.errors import Ending
    from lit_ddp.run.spawn_launcher import CarryBackLauncher
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


class FakeStream:
    """``torch.cuda.Stream`` and ``torch.cuda.stream(...)``: says which stream is current."""

    current = "default"

    def __init__(self, device=None):
        self.name = "side"

    def wait_stream(self, other):
        pass


class FakeEvent:
    log: list = []

    def record(self, stream=None):
        FakeEvent.log.append(("record", getattr(stream, "name", FakeStream.current)))

    def synchronize(self):
        FakeEvent.log.append(("event.synchronize", None))


class FakeWork:
    def wait(self):
        FakeEvent.log.append(("work.wait", FakeStream.current))


def test_on_cuda_the_per_step_path_copies_and_syncs_nothing_on_the_host(monkeypatch):
    """StepSync's batch end under a mocked ``torch.cuda`` (2 ranks): the flags are filled where the row lives, the
    gather is waited for by a side stream and copied from there; the host reads nothing in the step (no ``.cpu()``,
    ``.item()``, ``.tolist()``, ``synchronize()``, no blocking copy), and waits on one event a step later."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from lit_ddp.callbacks import step_sync

    @contextlib.contextmanager
    def on_stream(stream):
        before, FakeStream.current = FakeStream.current, stream.name
        yield
        FakeStream.current = before

    for name, fake in (("Stream", FakeStream), ("Event", FakeEvent), ("stream", on_stream),
                       ("current_stream", lambda device=None: FakeStream.current)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: FakeEvent.log.append(("kept", stream.name)))

    def refused(what):
        def call(*args, **kwargs):
            raise AssertionError(f"{what} in the step: a host sync on CUDA")

        return call

    gathers = []

    def all_gather_started(output, row):
        gathers.append(row.clone())
        output.copy_(torch.cat([row, row]))
        return FakeWork()

    sync = StepSync(sigterm_every_n_steps=1)
    sync._device = torch.device("cpu")  # the tensors are the CPU's; every CUDA call is the fakes'
    sync._host_copy = step_sync._HostCopy(torch.device("cpu"))
    sync._requeue = sync._requeued = False
    sync._start(2)
    monkeypatch.setattr(step_sync._torch, "all_gather_started", all_gather_started)
    monkeypatch.setattr(step_sync, "is_last_step", lambda trainer, batch_idx: False)
    trainer = SimpleNamespace(world_size=2, global_step=0, should_stop=False, profiler=None, callbacks=[])
    results = []
    with monkeypatch.context() as step:  # the per-step path: no host read, no sync
        for method in ("cpu", "item", "tolist"):
            step.setattr(torch.Tensor, method, refused(f"Tensor.{method}()"))
        step.setattr(torch.cuda, "synchronize", refused("torch.cuda.synchronize()"))
        for global_step in (1, 2):
            sync.on_train_batch_start(trainer, None, None, global_step - 1)
            trainer.global_step = global_step
            sync.put("loss", torch.tensor([0.5 * global_step]), lambda step, columns: results.append(columns.clone()))
            sync._sigterm = global_step == 2
            sync.on_train_batch_end(trainer, None, None, None, global_step - 1)
    # Step 1's row: sent at its end, waited for on the side stream, read at step 2's end through its event.
    sent = [("work.wait", "side"), ("record", "side"), ("kept", "side")]  # the gathered row kept for the side stream
    assert FakeEvent.log == [*sent, ("event.synchronize", None), *sent], FakeEvent.log
    assert [g.numpy().tolist() for g in gathers] == [[0.0, 0.0, 0.5], [1.0, 0.0, 1.0]]  # flags, then the loss
    assert len(results) == 1 and results[0].numpy().tolist() == [[0.5], [0.5]]
    sync._finish(trainer)  # step 2's row, with rank 0's SIGTERM flag: every rank stops
    assert trainer.should_stop and len(results) == 2


def test_no_gather_is_in_flight_when_a_profiler_starts_or_stops(monkeypatch):
    """Gloo ends a collective's profiler range on its worker thread: a gather still in flight when PhaseTimer's
    profiler starts (at step 2) or stops (at step 5) raced the profiler and crashed a rank. The row sent at the end
    of the step before each is read at once; under Lightning's PyTorchProfiler (it toggles inside steps) always."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.profilers import PyTorchProfiler

    from lit_ddp.callbacks import step_sync

    monkeypatch.setattr(
        step_sync._torch, "all_gather_started", lambda out, row: [out.copy_(torch.cat([row, row])), FakeWork()][1]
    )
    monkeypatch.setattr(step_sync, "is_last_step", lambda trainer, batch_idx: False)

    def in_flight_after_each_step(profiler):
        sync = StepSync(sigterm_every_n_steps=1)
        sync._device, sync._requeue, sync._requeued = torch.device("cpu"), False, False
        sync._start(2)
        timer = SimpleNamespace(profiled_steps=range(2, 5))  # PhaseTimer's: steps 2-4 profiled
        trainer = SimpleNamespace(world_size=2, global_step=0, should_stop=False, profiler=profiler, callbacks=[timer])
        left = []
        for step in range(7):
            sync.on_train_batch_start(trainer, None, None, step)
            trainer.global_step = step + 1  # the batch end of step `step`: the next to start is step + 1
            sync.on_train_batch_end(trainer, None, None, None, step)
            left.append(sync._in_flight is not None)
        return left

    #       steps 0     1      2     3     4      5     6: the profiler starts at step 2's start, stops at step 5's
    assert in_flight_after_each_step(None) == [True, False, True, True, False, True, True]
    assert not any(in_flight_after_each_step(PyTorchProfiler()))
