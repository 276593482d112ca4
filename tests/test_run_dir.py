"""Every run gets its own log folder, even when two start together in one place."""

import csv
import os

import pytest

from lit_ddp.run.run_dir import VERSION_ENV, claim_version
from tests.runner import start_fit

RUN = ("--model.dim", "16")


def rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.mark.slow
def test_two_runs_started_together_never_share_a_folder(tmp_path):
    # Real runs, end to end: a pair of 2-rank runs and a pair of 1-rank ones. Whether a pair meets at the very
    # mkdir is luck, so the clash itself is forced in test_a_version_another_run_creates_first_is_never_shared (10
    # pairs raced here before it existed).
    for attempt in range(2):
        # The folder is claimed by the launching process before any rank starts: one rank per run is enough to
        # race for it, and the first pair runs 2 ranks each, which must write into their launcher's folder.
        run = (*RUN, "--devices", "2" if attempt == 0 else "1")
        with start_fit(*run, cwd=tmp_path) as first, start_fit(*run, cwd=tmp_path) as second:
            codes = first.wait(timeout=90), second.wait(timeout=90)
            assert codes == (0, 0), (first.stderr[-2000:], second.stderr[-2000:])
        folders = sorted(p.name for p in (tmp_path / "runs" / "mini_train").iterdir())
        assert folders == sorted(f"version_{n}" for n in range(2 * attempt + 2)), folders
    for folder in (tmp_path / "runs" / "mini_train").iterdir():
        steps = [int(row["step"]) for row in rows(folder / "metrics.csv")]
        assert steps == [0, 1, 2, 3, 4], (folder, steps)  # its own five steps, no one else's


def test_a_claimed_version_skips_taken_ones_and_reaches_every_logger(tmp_path, monkeypatch):
    monkeypatch.delenv(VERSION_ENV, raising=False)
    for name in ("version_0", "version_3", "other"):
        (tmp_path / "runs" / "x" / name).mkdir(parents=True)
    logger = {
        "class_path": "CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "runs"), "name": "x", "version": None},
    }
    second = {"class_path": "TensorBoardLogger", "init_args": {"save_dir": str(tmp_path / "tb"), "name": "x"}}
    config = {"logger": [logger, second]}
    assert claim_version(config) == 4
    assert logger["init_args"]["version"] == second["init_args"]["version"] == 4
    assert (tmp_path / "runs" / "x" / "version_4").is_dir() and (tmp_path / "tb" / "x" / "version_4").is_dir()


def test_a_launched_rank_takes_its_launchers_version_and_other_ranks_claim_nothing(tmp_path, monkeypatch):
    logger = {"init_args": {"save_dir": str(tmp_path), "name": "x", "version": None}}
    monkeypatch.setenv(VERSION_ENV, f"{os.getppid()}:7")  # as if this process's parent had claimed 7
    assert claim_version({"logger": logger}) == 7 and logger["init_args"]["version"] == 7
    monkeypatch.setenv(VERSION_ENV, "1:7")  # a stale value from some other launcher
    monkeypatch.setenv("RANK", "1")
    logger["init_args"]["version"] = None
    assert claim_version({"logger": logger}) is None
    assert not (tmp_path / "x").exists()


def test_a_version_another_run_creates_first_is_never_shared(tmp_path, monkeypatch):
    """The race forced: between this run's look at the folder (version_0 and version_3 there: it picks 4) and its
    ``mkdir``, another run creates version_4, and then version_5 too. This one must take version_6, the first it
    created itself, and leave the others' folders as they were."""
    import pathlib

    monkeypatch.delenv(VERSION_ENV, raising=False)
    root = tmp_path / "runs" / "x"
    for name in ("version_0", "version_3"):
        (root / name).mkdir(parents=True)
    real_mkdir = pathlib.Path.mkdir
    others = []

    def mkdir(self, *args, **kwargs):
        if self.parent == root and self.name in ("version_4", "version_5") and self.name not in others:
            others.append(self.name)
            real_mkdir(self)  # the other run, just before this one
            (self / "metrics.csv").write_text("the other run's\n")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    logger = {"init_args": {"save_dir": str(tmp_path / "runs"), "name": "x", "version": None}}
    version = claim_version({"logger": logger})
    monkeypatch.undo()
    assert version == logger["init_args"]["version"] == 6, f"claimed version_{version}, which another run created"
    assert others == ["version_4", "version_5"]  # the clash did happen, twice
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_3", "version_4", "version_5", "version_6"]
    for name in ("version_4", "version_5"):
        assert [p.name for p in (root / name).iterdir()] == ["metrics.csv"]
