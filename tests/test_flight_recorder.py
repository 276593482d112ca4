"""``python -m lit_ddp.report --flight-recorder DIR`` on dumps that real torch code writes here: a 2-rank gloo DDP
job whose rank 1 calls one collective more (``tests/flight_dumps.py``)."""

import os
import pickle
import re

import pytest
from torch.multiprocessing import ProcessExitedException

from lit_ddp import report
from lit_ddp.analysis import flight_recorder
from lit_ddp.run import hangs, launchers, lifecycle
from tests.runner import run_module


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fr")
    result = run_module("tests.flight_dumps", str(directory), cwd=directory, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["fr_trace_rank0", "fr_trace_rank1", "json"]
    return directory


@pytest.mark.timeout(120)
def test_the_dumps_are_read_ddp_aware_and_compared(dumps, capsys):
    assert report.main(["--flight-recorder", str(dumps)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Flight Recorder dumps of 2 rank(s) in {dumps}:"
    rank0 = (
        r"rank 0: \d+ collectives \(3 DDP gradient bucket all-reduces in 3 backward pass\(es\)\); the last, "
        r"#(\d+): all_reduce Float\[9\] \(DDP gradient bucket 0\) \(scheduled\)$"
    )
    assert re.match(rank0, lines[1]), lines
    last = int(re.search(r"#(\d+)", lines[1]).group(1))
    assert lines[3] == (
        f"collective #{last + 1}: rank 1 called all_reduce Float[1] at step 2, after the backward (flight_dumps.py:27 "
        "rank_main: dist.all_reduce(torch.ones(1), async_op=True)); rank 0 never arrived: it had called only up to "
        f"#{last}, all_reduce Float[9] (DDP gradient bucket 0) at step 2, backward"
    )


def test_a_folder_without_dumps_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main(["--flight-recorder", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--flight-recorder: {tmp_path}: no Flight Recorder dump" in capsys.readouterr().err


def as_nccl_writes_it(dump: dict) -> dict:
    """A real dump in the form NCCL's watchdog pickles it on a timeout: the same Flight Recorder entries (torch's
    FlightRecorder is one for both backends) named ``nccl:<op>``, the default group keyed ``"0"``, the ops that
    completed with their ``duration_ms``, the last one ``started``, and NCCL's ``nccl_comm_state`` (as torch's own
    tests build theirs: test/distributed/flight_recorder/test_fr_analysis.py's ``create_one_entry``)."""
    entries = [dict(e) for e in dump["entries"]]
    for entry in entries:
        entry["profiling_name"] = "nccl:" + entry["profiling_name"].partition(":")[2]
        entry["state"], entry["duration_ms"] = "completed", 0.1
    entries[-1]["state"], entries[-1]["duration_ms"] = "started", None
    config = {"0" if name == "" else name: group for name, group in dump["pg_config"].items()}
    return {**dump, "pg_config": config, "entries": entries, "nccl_comm_state": {}}


@pytest.mark.timeout(120)
def test_nccl_pickles_and_torchs_json_are_read_too(dumps, tmp_path, capsys):
    assert report.main(["--flight-recorder", str(dumps)]) == 0
    gloo = capsys.readouterr().out.splitlines()
    nccl = tmp_path / "nccl"
    nccl.mkdir()
    for rank in (0, 1):
        dump = pickle.loads((dumps / f"fr_trace_rank{rank}").read_bytes())
        (nccl / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(as_nccl_writes_it(dump)))
    assert report.main(["--flight-recorder", str(nccl)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].replace("(started)", "(scheduled)") == gloo[1] and lines[3] == gloo[3]
    assert flight_recorder.dumps_divergence(nccl) == gloo[3]

    assert report.main(["--flight-recorder", str(dumps / "json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "(JSON dumps hold no Python stacks: DDP's buckets, the steps and the user's lines are not named)"
    assert re.match(r"collective #(\d+): rank 1 called all_reduce Float\[1\]; rank 0 never arrived: it had called "
                    r"only up to #\d+, all_reduce Float\[9\]$", lines[-1]), lines  # fmt: skip


def test_only_the_dumps_of_this_job_are_read(dumps, tmp_path):
    """The launcher reads the dumps written since its ranks started: an older job's in the folder are not its."""
    for rank in (0, 1):
        path = tmp_path / f"nccl_trace_rank_{rank}"
        path.write_bytes((dumps / f"fr_trace_rank{rank}").read_bytes())
        os.utime(path, (1000.0, 1000.0))
    assert hangs.dumps_diagnosis(tmp_path, since=2000.0) is None
    line = hangs.dumps_diagnosis(tmp_path, since=0.0)
    assert line.startswith("collective #") and line.endswith(f"(NCCL's Flight Recorder dumps in {tmp_path})")


def test_a_killed_rank_is_explained_by_the_dumps(dumps, tmp_path, capsys):
    """A ddp_spawn rank that NCCL's watchdog aborted: the launcher's exception, and lit_ddp.fit's line, carry what
    the dumps show."""
    launcher = object.__new__(launchers.MultiProcessingLauncher)
    launcher.dumps, launcher.started = dumps, 0.0
    why = launcher.why_exited()
    assert why == hangs.dumps_diagnosis(dumps, 0.0) and why.startswith("collective #")

    def run():
        err = ProcessExitedException("process 1 terminated with signal SIGABRT", 1, 99, -6, "SIGABRT")
        err.lit_ddp_diagnosis = why
        raise err

    assert lifecycle.exit_code(run, prog="lit_ddp") == 1
    assert capsys.readouterr().err == f"lit_ddp: rank 1 exited with signal SIGABRT: {why}\n"


def test_nccl_is_told_to_dump_into_the_run_folder_where_the_user_said_nothing(tmp_path):
    environ: dict[str, str] = {}
    assert hangs.prepare_nccl_dumps("gloo", str(tmp_path), environ) is None and environ == {}
    folder = hangs.prepare_nccl_dumps("nccl", str(tmp_path), environ)
    assert folder == (tmp_path / "flight_recorder").resolve() and folder.is_dir()
    assert environ == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/nccl_trace_rank_",
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{folder}/nccl_trace_rank_"}  # fmt: skip
    mine = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "mine" / "trace_"), "TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    environ = dict(mine)
    assert hangs.prepare_nccl_dumps("cpu:gloo,cuda:nccl", str(tmp_path), environ) == tmp_path / "mine"
    assert {k: environ[k] for k in mine} == mine and "TORCH_FR_BUFFER_SIZE" not in environ
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert hangs.prepare_nccl_dumps("nccl", str(tmp_path), {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}) is None
