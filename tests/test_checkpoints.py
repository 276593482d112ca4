"""Checkpoints: written atomically in a fixed place, resumed exactly, refused clearly when bad."""

import errno
import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from lit_ddp.run.checkpointing import AtomicCheckpointIO
from tests.runner import run_fit, run_fits, run_main
from tests.trainers import assert_same_checkpoint

CPU = ("--trainer.accelerator", "cpu")


def main_code_and_err(monkeypatch, capsys, *args) -> tuple[int, str]:
    """``lit-ddp-fit ARGS`` in this process, on the CPU: the exit code and stderr."""
    result = run_main(monkeypatch, capsys, *CPU, *args)
    return result.returncode, result.stderr.strip()


class Evil:
    def __reduce__(self):
        import os

        return os.system, ("touch PWNED",)


@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage", "malicious", "not_lightning"])
def test_bad_checkpoints_are_refused_in_one_line(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"{kind}.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        torch.save({"state_dict": {"w": torch.zeros(1000)}}, path)
        path.write_bytes(path.read_bytes()[:500])
    elif kind == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 100)
    elif kind == "malicious":
        with open(path, "wb") as f:
            torch.save({"state_dict": {}, "payload": Evil()}, f, pickle_module=pickle)
    else:
        torch.save({"weights": torch.zeros(3)}, path)
    code, err = main_code_and_err(monkeypatch, capsys, "--devices", "1", "--ckpt_path", str(path))
    assert code == 2
    assert len(err.splitlines()) == 1 and str(path) in err, err
    assert not (tmp_path / "PWNED").exists(), "the checkpoint's pickle ran code"
    # One whole sentence that says why, never torch's page that ends in advice to set weights_only=False.
    unreadable = f"lit-ddp-fit: error: --ckpt_path: {path} is not a readable checkpoint: "
    cut = "not a whole file written by torch.save (no zip archive: cut short, or another format)"
    expected = {
        "empty": f"lit-ddp-fit: error: --ckpt_path: {path} is empty",
        "truncated": unreadable + cut,
        "garbage": unreadable + cut,
        "malicious": unreadable + "it holds a Python object (posix.system); checkpoints are loaded as data only "
        "(weights_only=True)",
        "not_lightning": f"lit-ddp-fit: error: --ckpt_path: {path} is not a Lightning checkpoint (no state_dict)",
    }
    assert err == expected[kind]


def test_resume_from_nothing_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = main_code_and_err(monkeypatch, capsys, "--devices", "1", "--ckpt_path", "last")
    assert code == 2
    assert err == ("lit-ddp-fit: error: --ckpt_path last: no checkpoint at runs/mini_train/checkpoints/last.ckpt: "
                   "nothing to resume (write one with --checkpoint.every_n_steps N)")  # fmt: skip


def test_command_line_and_checkpoint_must_agree(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    common = ("--devices", "1", "--model.dim", "32")
    assert main_code_and_err(monkeypatch, capsys, *common, "--checkpoint.every_n_steps", "5")[0] == 0
    ckpt = tmp_path / "runs" / "mini_train" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    code, err = main_code_and_err(monkeypatch, capsys, "--devices", "1", "--model.dim", "16", "--ckpt_path", "last")
    assert code == 2
    assert "dim=32 in the checkpoint but 16 here" in err
    code, err = main_code_and_err(monkeypatch, capsys, *common, "--model.lr", "0.01", "--ckpt_path", "last")
    assert code == 2 and "lr=0.001 in the checkpoint but 0.01 here" in err


def test_atomic_save_keeps_the_old_checkpoint_when_a_save_dies(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, target)

    def dies_halfway(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise KeyboardInterrupt  # a kill in the middle of the write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    args = ("--devices", "2", "--model.dim", "64")
    straight, first = run_fits(  # at once: the straight run and the first half of the resumed one
        ((*args, "--trainer.max_steps", "10", "--checkpoint.every_n_steps", "10", "--trainer.logger.init_args.name",
          "straight"), tmp_path),
        ((*args, "--trainer.max_steps", "5", "--checkpoint.every_n_steps", "5", "--trainer.logger.init_args.name",
          "resumed"), tmp_path),
    )  # fmt: skip
    second = run_fit(*args, "--trainer.max_steps", "10", "--checkpoint.every_n_steps", "10", "--ckpt_path", "last",
                     "--trainer.logger.init_args.name", "resumed", cwd=tmp_path)  # fmt: skip
    for result in (straight, first, second):
        assert result.returncode == 0, result.stderr[-2000:]
    assert "Step 5, Loss" in second.stdout and "Step 4, Loss" not in second.stdout
    assert_same_checkpoint(tmp_path / "runs/straight/checkpoints/last.ckpt",
                           tmp_path / "runs/resumed/checkpoints/last.ckpt", global_step=10)  # fmt: skip


def test_runs_save_through_the_atomic_writer(tmp_path, monkeypatch, capsys):
    saved = []
    original = AtomicCheckpointIO.save_checkpoint

    def counting(self, checkpoint, path, storage_options=None):
        saved.append(path)
        original(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counting)
    monkeypatch.chdir(tmp_path)
    code, err = main_code_and_err(monkeypatch, capsys, "--devices", "1", "--model.dim", "8", "--trainer.max_steps",
                                  "3", "--checkpoint.every_n_steps", "1")  # fmt: skip
    assert code == 0, err
    assert [Path(p).name for p in saved] == ["last.ckpt"] * 3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_mid_epoch_resume_in_a_users_trainer_is_resumable_and_exact(make_trainer, tmp_path, capfd):
    """Outside the CLI (whose console drops known noise) Lightning warns on a mid-epoch resume unless the loader
    is resumable: RepeatBatch is (every batch is the same one; Lightning's restored batch counter ends the epoch),
    so no warning, and the run ends bitwise equal to an uninterrupted one, epochs included (6 steps per epoch)."""
    from lightning.pytorch import seed_everything

    from lit_ddp import FixedBatchDataModule, LinearRegression
    from lit_ddp.run.checkpointing import LastCheckpoint

    def fit(name, max_steps, every, ckpt_path=None):
        seed_everything(0)
        saver = LastCheckpoint(every_n_steps=every, dirpath=str(tmp_path / name))
        trainer = make_trainer(max_steps=max_steps, callbacks=[saver])
        trainer.fit(LinearRegression(dim=16), FixedBatchDataModule(dim=16, batch_size=4, steps_per_epoch=6),
                    ckpt_path=ckpt_path)  # fmt: skip
        return tmp_path / name / "last.ckpt"

    straight = fit("straight", 9, 9)
    fit("resumed", 4, 4)
    capfd.readouterr()
    resumed = fit("resumed", 9, 9, ckpt_path=tmp_path / "resumed" / "last.ckpt")
    out = capfd.readouterr()
    assert "not resumable" not in out.out + out.err, out.err[-2000:]
    assert_same_checkpoint(straight, resumed, global_step=9)
    assert torch.load(resumed, weights_only=True)["epoch"] == 1  # the second epoch, as uninterrupted


class FullDisk(io.BufferedWriter):
    """A file on a full disk: every flush fails (the data the buffer spilled before is on disk: a torn file)."""

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fails", ["flush", "fsync", "replace"])
def test_atomic_save_keeps_the_old_checkpoint_when_flushing_syncing_or_renaming_fails(tmp_path, monkeypatch, fails):
    """A disk that fills up, an fsync that reports a lost write, a rename refused: the error reaches the caller,
    the old ``last.ckpt`` is whole, and no partial file is left, under its name or beside it."""
    from lit_ddp.run import checkpointing

    writer = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    writer.save_checkpoint({"step": 1}, target)
    calls = []

    def fail(*args, **kwargs):
        calls.append(fails)
        raise OSError(errno.EIO, f"injected {fails} failure")

    if fails == "flush":
        monkeypatch.setattr(checkpointing, "open", lambda path, mode: FullDisk(io.FileIO(path, "w")), raising=False)
    else:  # a refused os.replace: os.rename is refused alike (a writer that falls back to a copy is not atomic)
        for name in ("fsync",) if fails == "fsync" else ("replace", "rename"):
            monkeypatch.setattr(os, name, fail)
    try:
        writer.save_checkpoint({"step": 2, "weights": torch.arange(100_000.0)}, target)  # 400 kB: buffers spill
        error = None
    except OSError as err:
        error = err
    monkeypatch.undo()
    assert error is not None, f"the save went on as if written when {fails} failed (injected failures raised: {calls})"
    assert ("No space left" if fails == "flush" else f"injected {fails} failure") in str(error), error
    assert target.is_file(), "the old checkpoint is gone"
    assert torch.load(target, weights_only=True) == {"step": 1}, "the old checkpoint was overwritten"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "a partial file was left behind"
